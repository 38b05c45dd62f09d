"""Converters between xckpt and foreign checkpoint formats (installed as `xckpt.converters`)."""
