"""The live view: the analysis engine run on each record as the recorder writes it.

`contract` (paths, event fields, settings) is light enough for the proxy's
own process; the view itself (`view`, `events`, `eventfiles`, `sink`) runs
in the builder child.
"""
