"""The recorder: the mitmproxy addon, its capture, record building, writer and child.

The only subpackage that imports mitmproxy (in `addon` and `proxy`); this
package's `__init__` imports nothing, so the builder child can import its
pure parts without mitmproxy.
"""
