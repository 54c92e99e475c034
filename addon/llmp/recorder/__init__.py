"""llmp.recorder."""
