"""llmp.demo.command."""
