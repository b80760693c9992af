"""Who is calling and what they may do: job token and mTLS identity (`auth`, `tls`),
the kernel's word on local ranks (`peercred`), and the role checks (`roles`).
"""
