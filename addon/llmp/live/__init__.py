"""llmp.live.view."""
