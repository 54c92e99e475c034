"""mitmdump entry point: `mitmdump -s addon/llmp_addon.py`.

Kept thin on purpose: mitmproxy hot-reloads this script, while the state
lives in the `llmp` package.
"""

import sys
from pathlib import Path

try:
    import llmp.recorder.addon
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import llmp.recorder.addon

addons = [llmp.recorder.addon.Recorder()]
