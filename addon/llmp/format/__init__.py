"""llmp.format."""
