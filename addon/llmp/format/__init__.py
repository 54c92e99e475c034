"""The llmp v1 formats, shared by the recorder and the analyzer.

Canonical JSON and FNV-1a (`canonical`), the record's schema (`schema`),
the one reader of a line (`lines`), measured values (`measure`), the
one-writer file lock (`lockfile`) and the `--tokenize` enrichment
(`token_counts`).  Imports neither the APIs nor anything above them.
"""
