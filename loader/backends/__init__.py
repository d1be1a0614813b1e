"""The shells that run the control plane (:mod:`loader.control`) over the stages: ``backend="ray"``
(:mod:`.ray_backend`: the coordinator actor and the reader-actor handles; :mod:`.reader`: the reader actors;
:mod:`.telemetry`: their Ray metrics) and ``backend="inline"`` (:mod:`.inline`: reader threads in this process).
The only modules of the loader, with the Ray Train adapter, that import Ray."""
