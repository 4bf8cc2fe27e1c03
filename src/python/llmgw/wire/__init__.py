"""Message types of each link (frozen attrs classes) and the one converter for them."""
