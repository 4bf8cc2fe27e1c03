"""What the control plane serves to nodes: engine archives (the mirror and its fill) and the
release files.
"""
