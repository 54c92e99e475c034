"""`llmp demo` and the fake model servers it (and the tests) run against."""
