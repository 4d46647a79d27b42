"""Each Hub family's chat template (what the checkpoint ships, byte for byte) and its training template (the
same with ``{% generation %}`` markers), one module per family: long strings kept apart from the family record."""
