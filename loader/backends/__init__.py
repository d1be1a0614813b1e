"""The shells that run the control plane (:mod:`loader.control`) over the stages: ``backend="ray"``
(:mod:`.ray_backend`: what a trainer process holds; :mod:`.coordinator`: where the control plane runs, the named
loader's coordinator actor; :mod:`.ray_readers`: the control plane's calls to the reader actors; :mod:`.reader`: the
reader actors; :mod:`.telemetry`: their Ray metrics) and ``backend="inline"`` (:mod:`.inline`: reader threads in this process).
The only modules of the loader, with the Ray Train adapter, that import Ray."""
