def register_cross_targets():
    pass
