"""Code that runs inside the jail: the long-lived worker and the seccomp filter it installs.

Stdlib only and self-contained: the pool binds this directory read-only into the jail, where the rest
of posttrain (and the project tree) is not visible. Nothing here imports posttrain.
"""
