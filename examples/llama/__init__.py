"""A Llama-style decoder trained by Stalwart's 3D loop (entry shape 2)."""
