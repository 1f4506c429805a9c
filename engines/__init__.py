"""The engines: ``model`` (what the model is, shared by both), ``inference`` (how it is served), ``training``
(how it is trained), and ``device`` (device helpers both use)."""
