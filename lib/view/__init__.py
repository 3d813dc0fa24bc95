"""The rollout viewer: ``python -m lib.view RUN_DIR`` serves a page of the run's curves and kept samples
(lib/samples) to open in a browser (docs/viewer.md). ``read``: the run folder's values, without a page; ``page``: the
page (NiceGUI)."""
