"""llmp.apis."""
