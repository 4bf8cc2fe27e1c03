"""Getting engines onto a node: download with resume and sha256, safe unpacking, installs
that are checked to run before they are switched to."""
