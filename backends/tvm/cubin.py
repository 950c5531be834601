"""CUDA device code compiled ahead of time: the CUDA C source TVM generates is compiled by ``nvcc`` to one fatbin
holding an sm_90a and an sm_80 cubin, and embedded in the exported library instead of the source, so the library
loads on a machine with only the CUDA driver and ``libtvm_runtime_cuda.so`` (no nvcc, no NVRTC).

The pip TVM's codegen (``BuildCUDA``) stores the source with format ``"cuda"``; its runtime compiles that with
NVRTC (``tvm_callback_cuda_compile``) when the library is loaded. ``embed_fatbin`` is the ``fpack_imports`` hook of
``export_library``: it serialises the import tree as TVM does (``runtime.ModulePackImportsToTensor``), replaces each
``cuda`` entry's ``(fmt, fmap, code)`` by ``("fatbin", fmap, <fatbin>)`` (the layout ``CUDAModuleNode::SaveToBytes``
writes and ``ffi.Module.load_from_bytes.cuda`` reads; its loader hands a non-"cuda" format straight to
``cuModuleLoadData``) and writes the blob as the C array ``__tvm_ffi__library_bin`` (what ``PackImportsToC``
writes). Layout source: apache/tvm ``src/target/codegen.cc`` (ModuleSerializer, PackImportsToBytes) and
``src/backend/cuda/runtime/cuda_module.cc``.
"""
from __future__ import annotations

import os
import shutil
import struct
import subprocess
import tempfile

from k3ir.errors import K3BackendError

#: the architectures every CUDA library carries SASS for
CUDA_ARCHS = ("sm_90a", "sm_80")
FATBIN_MAGIC = 0xBA55ED50


def find_nvcc() -> str | None:
    """Path of ``nvcc``: ``$CUDA_HOME/bin``, then PATH, then the pip ``nvidia-cuda-nvcc`` package; None if absent."""
    cands = []
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            cands.append(os.path.join(os.environ[env], "bin", "nvcc"))
    cands.append(shutil.which("nvcc") or "")
    try:
        import nvidia.cu13 as cu  # type: ignore[import-not-found]
        cands.append(os.path.join(next(iter(cu.__path__)), "bin", "nvcc"))
    except ImportError:
        pass
    return next((c for c in cands if c and os.access(c, os.X_OK)), None)


def find_cuobjdump() -> str | None:
    """Path of ``cuobjdump`` (beside nvcc, on PATH, or from the pip ``nvidia-cuda-cuobjdump`` package)."""
    cands = [shutil.which("cuobjdump") or ""]
    nvcc = find_nvcc()
    if nvcc:
        cands.append(os.path.join(os.path.dirname(nvcc), "cuobjdump"))
    try:
        import nvidia.cu13 as cu  # type: ignore[import-not-found]
        cands.append(os.path.join(next(iter(cu.__path__)), "bin", "cuobjdump"))
    except ImportError:
        pass
    return next((c for c in cands if c and os.access(c, os.X_OK)), None)


def find_nvdisasm() -> str | None:
    """Path of ``nvdisasm`` (which ``cuobjdump --dump-sass`` runs): PATH, beside nvcc, the pip
    ``nvidia-cuda-nvdisasm`` package, or the copy Triton ships."""
    cands = [shutil.which("nvdisasm") or ""]
    for tool in (find_nvcc(), shutil.which("cuobjdump")):
        if tool:
            cands.append(os.path.join(os.path.dirname(tool), "nvdisasm"))
    for mod in ("nvidia.cu13", "triton.backends.nvidia"):
        try:
            import importlib
            cands.append(os.path.join(next(iter(importlib.import_module(mod).__path__)), "bin", "nvdisasm"))
        except ImportError:
            pass
    return next((c for c in cands if c and os.access(c, os.X_OK)), None)


def compile_fatbin(source: str, archs: tuple[str, ...] = CUDA_ARCHS, nvcc: str | None = None) -> bytes:
    """nvcc ``source`` (TVM's CUDA C) to a fatbin with a cubin per ``archs`` entry (``sm_90a`` -> compute_90a /
    sm_90a). Raises K3BackendError when nvcc is missing or fails (its last lines)."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise K3BackendError("tvm-cuda: nvcc not found (CUDA toolkit, or pip install 'nvidia-cuda-nvcc==13.0.88' "
                             "'nvidia-nvvm==13.0.88' 'nvidia-cuda-crt==13.0.88' 'nvidia-cuda-runtime==13.0.88')")
    with tempfile.TemporaryDirectory(prefix="k3ir-nvcc-") as d:
        src, out = os.path.join(d, "kernels.cu"), os.path.join(d, "kernels.fatbin")
        with open(src, "w") as f:
            f.write(source)
        cmd = [nvcc, "--fatbin", "-O3", "-std=c++17", "-w", "--threads", "0", "-o", out, src]
        for a in archs:
            cmd.append(f"-gencode=arch=compute_{a[3:]},code={a}")
        p = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if p.returncode != 0:
            tail = " | ".join((p.stderr or p.stdout).strip().splitlines()[-4:])
            raise K3BackendError(f"tvm-cuda: nvcc failed on the generated kernels: {tail}")
        with open(out, "rb") as f:
            return f.read()


# ---- TVM's module serialisation -------------------------------------------------------------------------------
class _Reader:
    def __init__(self, data: bytes, pos: int = 0):
        self.data, self.pos = data, pos

    def u64(self) -> int:
        (v,) = struct.unpack_from("<Q", self.data, self.pos)
        self.pos += 8
        return v

    def raw(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise ValueError("truncated module bytes")
        b = self.data[self.pos:self.pos + n]
        self.pos += n
        return b

    def str(self) -> bytes:
        return self.raw(self.u64())


def _w(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def serialize_device_module(dev) -> bytes:
    """``SaveToBytes`` of device module ``dev`` (the first entry of its own packed import tree)."""
    import tvm_ffi
    blob = bytes(tvm_ffi.get_global_func("runtime.ModulePackImportsToTensor")(dev).numpy().tobytes())
    entries, _, _ = unpack_blob(blob)
    return entries[0][1]


def parse_device_bytes(data: bytes) -> tuple[str, dict[str, dict], bytes]:
    """(fmt, {function name: {"args": n, "launch": [tags]}}, code) of a CUDA-layout device module's bytes."""
    r = _Reader(data)
    fmt = r.str().decode()
    fmap = {}
    for _ in range(r.u64()):
        key = r.str().decode()
        r.str()                                   # FunctionInfo.name
        nargs = r.u64()
        r.raw(4 * nargs)                          # DLDataType per argument
        launch = [r.str().decode() for _ in range(r.u64())]
        r.raw(4 * r.u64())                        # arg_extra_tags (int32 each)
        fmap[key] = {"args": nargs, "launch": launch}
    code = r.str()
    if r.pos != len(data):
        raise ValueError("trailing bytes after the device code")
    return fmt, fmap, code


def parse_webgpu_bytes(data: bytes) -> tuple[dict[str, dict], dict[str, str]]:
    """({function name: {"args": n, "launch": [tags]}}, {function name: WGSL source}) of a webgpu device module's
    bytes: the FunctionInfo table as ``parse_device_bytes`` reads it, then the per-kernel source map (no format
    string: the layout TVM 0.27's WebGPU module writes and the web runtime's ``WebGPUModuleLoadFromBytes`` reads)."""
    r = _Reader(data)
    fmap = {}
    for _ in range(r.u64()):
        key = r.str().decode()
        r.str()
        nargs = r.u64()
        r.raw(4 * nargs)
        launch = [r.str().decode() for _ in range(r.u64())]
        r.raw(4 * r.u64())
        fmap[key] = {"args": nargs, "launch": launch}
    smap = {}
    for _ in range(r.u64()):
        key = r.str().decode()
        smap[key] = r.str().decode()
    if r.pos != len(data):
        raise ValueError("trailing bytes after the WGSL source map")
    return fmap, smap


def unpack_blob(blob: bytes) -> tuple[list[tuple[str, bytes]], list[int], list[int]]:
    """(entries [(kind, bytes)], import_tree_row_ptr, child_indices) of a packed library blob (8-byte size header,
    then TVM's ModuleSerializer stream). A ``_lib`` entry (the host DSO placeholder) has empty bytes."""
    r = _Reader(blob)
    n = r.u64()
    if n != len(blob) - 8:
        raise ValueError(f"blob header says {n} bytes, has {len(blob) - 8}")
    row = [r.u64() for _ in range(r.u64())]
    child = [r.u64() for _ in range(r.u64())]
    entries = []
    for _ in range(len(row) - 1):
        key = r.str().decode()
        entries.append((key, b"" if key == "_lib" else r.str()))
    return entries, row, child


def pack_blob(entries: list[tuple[str, bytes]], row: list[int], child: list[int]) -> bytes:
    """Inverse of ``unpack_blob``."""
    body = struct.pack("<Q", len(row)) + b"".join(struct.pack("<Q", v) for v in row)
    body += struct.pack("<Q", len(child)) + b"".join(struct.pack("<Q", v) for v in child)
    for key, data in entries:
        body += _w(key.encode())
        if key != "_lib":
            body += _w(data)
    return struct.pack("<Q", len(body)) + body


def fatbin_entry(data: bytes, archs: tuple[str, ...] = CUDA_ARCHS) -> bytes:
    """A ``cuda`` entry's bytes with its CUDA source (fmt ``cuda``) replaced by the nvcc fatbin (fmt ``fatbin``);
    an entry already holding binary code is returned unchanged."""
    fmt, _, code = parse_device_bytes(data)
    if fmt != "cuda":
        return data
    r = _Reader(data)
    r.str()
    fmap_start = r.pos
    fmap_end = len(data) - 8 - len(code)
    fatbin = compile_fatbin(code.decode(), archs)
    return _w(b"fatbin") + data[fmap_start:fmap_end] + _w(fatbin)


def c_source(blob: bytes, symbol: str = "__tvm_ffi__library_bin") -> str:
    """The C file ``PackImportsToC`` writes for ``blob`` (non-system library)."""
    rows = ",\n".join(",".join(f"0x{b:02x}" for b in blob[i:i + 20]) for i in range(0, len(blob), 20))
    return (f"#ifdef __cplusplus\nextern \"C\" {{\n#endif\nextern const unsigned char {symbol}[];\n"
            f"const unsigned char {symbol}[{len(blob)}] = {{\n{rows}\n}};\n#ifdef __cplusplus\n}}\n#endif\n")


def make_fpack_imports(archs: tuple[str, ...] = CUDA_ARCHS, sources: dict[str, str] | None = None):
    """The ``fpack_imports`` hook of ``export_library`` that embeds fatbins for ``archs`` (see the module doc);
    ``sources`` (when given) receives each CUDA entry's source, keyed ``cuda_<i>``."""
    import tvm_ffi

    def fpack(mod, is_system_lib: bool, prefix: str, workspace_dir: str) -> str:
        if is_system_lib or prefix:
            raise K3BackendError("tvm-cuda: fatbin embedding supports shared libraries only (not a system lib)")
        blob = bytes(tvm_ffi.get_global_func("runtime.ModulePackImportsToTensor")(mod).numpy().tobytes())
        entries, row, child = unpack_blob(blob)
        out = []
        for i, (key, data) in enumerate(entries):
            if key == "cuda":
                if sources is not None:
                    fmt, _, code = parse_device_bytes(data)
                    if fmt == "cuda":
                        sources[f"cuda_{i}"] = code.decode()
                data = fatbin_entry(data, archs)
            out.append((key, data))
        path = os.path.join(workspace_dir, "devc.c")
        with open(path, "w") as f:
            f.write(c_source(pack_blob(out, row, child)))
        return path
    return fpack


# ---- checks on a written library ------------------------------------------------------------------------------
def library_blob(path: str) -> bytes:
    """The packed import blob of the ELF64 little-endian shared library at ``path``: the bytes of its
    ``__tvm_ffi__library_bin`` symbol (8-byte size, then the stream), found through ``.symtab``/``.dynsym``.
    Raises K3BackendError when the file is not such a library or has no device code blob."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise K3BackendError(f"{path}: not a 64-bit little-endian ELF shared library")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    for sec in secs:
        if sec[1] not in (2, 11):                 # SHT_SYMTAB, SHT_DYNSYM
            continue
        strtab = secs[sec[6]]
        for j in range(sec[5] // 24):
            name_off, _info, _other, shndx, value, _size = struct.unpack_from("<IBBHQQ", data, sec[4] + j * 24)
            start = strtab[4] + name_off
            if data[start:data.index(b"\0", start)] != b"__tvm_ffi__library_bin" or shndx == 0 or shndx >= shnum:
                continue
            host = secs[shndx]
            off = value - host[3] + host[4]
            (n,) = struct.unpack_from("<Q", data, off)
            return data[off:off + 8 + n]
    raise K3BackendError(f"{path}: no __tvm_ffi__library_bin (not a TVM library with device code)")


def _leb(data: bytes, pos: int) -> tuple[int, int]:
    """(value, next position) of the unsigned LEB128 number at ``pos`` (WebAssembly's integer encoding)."""
    v = shift = 0
    while True:
        b = data[pos]
        pos += 1
        v |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return v, pos


def wasm_data_segments(data: bytes) -> list[bytes]:
    """The bytes of every data segment of a WebAssembly module or object file (section 11; segment flags 0: active
    in memory 0 with an ``i32.const`` offset, 1: passive, 2: active with a memory index; the WebAssembly core
    spec's binary format). Raises K3BackendError when ``data`` is not WebAssembly."""
    if data[:4] != b"\0asm":
        raise K3BackendError("not a WebAssembly module (no \\0asm magic)")
    pos, out = 8, []
    while pos < len(data):
        sid = data[pos]
        size, pos = _leb(data, pos + 1)
        end = pos + size
        if sid == 11:
            n, p = _leb(data, pos)
            for _ in range(n):
                flags, p = _leb(data, p)
                if flags == 2:
                    _, p = _leb(data, p)
                if flags in (0, 2):           # the offset: a constant expression ending in 0x0b
                    p = data.index(b"\x0b", p) + 1
                length, p = _leb(data, p)
                out.append(data[p:p + length])
                p += length
        pos = end
    return out


def webgpu_library_kernels(path: str) -> dict[str, str]:
    """{kernel name: WGSL source} of the webgpu device module packed in the ``.tar`` a webgpu build writes
    (``gpu.write_library``: wasm32 objects; the packed import blob, ``__tvm_ffi__library_bin``, is the data segment
    that starts with its own size), read from the webgpu entry's function table and source map (``parse_webgpu_bytes``).
    Raises K3BackendError when the tar holds no such blob or no webgpu module."""
    import tarfile
    with tarfile.open(path) as t:
        objs = [t.extractfile(m).read() for m in t.getmembers() if m.isfile()]
    for obj in objs:
        if obj[:4] != b"\0asm":
            continue
        for seg in wasm_data_segments(obj):
            if len(seg) >= 8 and struct.unpack_from("<Q", seg)[0] == len(seg) - 8:
                entries, _, _ = unpack_blob(seg)
                dev = [parse_webgpu_bytes(d) for k, d in entries if k == "webgpu"]
                if dev:
                    return {name: src for _, smap in dev for name, src in smap.items()}
    raise K3BackendError(f"{path}: no packed webgpu module in its WebAssembly objects")


def wgsl_required_limits(kernels: dict[str, str]) -> dict[str, int]:
    """The WebGPU device limits (``GPUSupportedLimits`` names, for ``requestDevice``'s ``requiredLimits``) that running
    every WGSL kernel of ``kernels`` ({name: source}) needs: storage buffers per shader stage, workgroup storage bytes
    (``var<workgroup>`` arrays) and invocations per workgroup (``@workgroup_size``). WebGPU's defaults are 8, 16384
    and 256 (W3C WebGPU, "Limits")."""
    import re
    size = {"f32": 4, "i32": 4, "u32": 4, "f16": 2}
    out = {"maxStorageBuffersPerShaderStage": 0, "maxComputeWorkgroupStorageSize": 0,
           "maxComputeInvocationsPerWorkgroup": 0}
    for src in kernels.values():
        wg = re.search(r"@workgroup_size\((\d+), (\d+), (\d+)\)", src)
        shared = sum(int(n) * size.get(t, 4) for t, n in re.findall(r"var<workgroup> \w+ : array<(\w+), (\d+)>", src))
        for key, v in (("maxStorageBuffersPerShaderStage", src.count("var<storage")),
                       ("maxComputeWorkgroupStorageSize", shared),
                       ("maxComputeInvocationsPerWorkgroup", int(wg[1]) * int(wg[2]) * int(wg[3]) if wg else 0)):
            out[key] = max(out[key], v)
    return out


def embedded_cuda(path: str) -> list[tuple[str, dict[str, dict], bytes]]:
    """[(fmt, fmap, code)] of every CUDA device module embedded in the library at ``path``."""
    entries, _, _ = unpack_blob(library_blob(path))
    return [parse_device_bytes(d) for k, d in entries if k == "cuda"]


def cuobjdump_functions(fatbin: bytes, cuobjdump: str | None = None) -> dict[str, set[str]]:
    """arch (``sm_90a``) -> names of the kernels whose SASS the fatbin holds, from ``cuobjdump --list-elf`` and
    ``--dump-sass`` (which needs ``nvdisasm``: ``find_nvdisasm``). Raises K3BackendError when cuobjdump is missing
    or fails."""
    import re
    tool = cuobjdump or find_cuobjdump()
    if tool is None:
        raise K3BackendError("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    with tempfile.TemporaryDirectory(prefix="k3ir-cuobjdump-") as d:
        p = os.path.join(d, "kernels.fatbin")
        with open(p, "wb") as f:
            f.write(fatbin)
        env = dict(os.environ)
        dis = find_nvdisasm()
        if dis:
            env["PATH"] = os.path.dirname(dis) + os.pathsep + env.get("PATH", "")
        elfs = subprocess.run([tool, "--list-elf", p], capture_output=True, text=True, check=False, env=env)
        sass = subprocess.run([tool, "--dump-sass", p], capture_output=True, text=True, check=False, env=env)
    if elfs.returncode != 0 or sass.returncode != 0:
        raise K3BackendError(f"cuobjdump failed: {(elfs.stderr or sass.stderr).strip()[:200]}")
    archs = set(re.findall(r"\.(sm_\w+?)\.cubin", elfs.stdout))
    out: dict[str, set[str]] = {a: set() for a in archs}
    arch = None
    for line in sass.stdout.splitlines():
        m = re.search(r"arch = (sm_\w+)", line)
        if m:
            arch = m.group(1)
            out.setdefault(arch, set())
        m = re.search(r"Function : (\S+)", line)
        if m and arch:
            out[arch].add(m.group(1))
    return out
