"""Sparse methods: one runtime file each, discovered by ``sparseengine.method_registry``."""
