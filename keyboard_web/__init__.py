"""fedkey web keyboard: suggestions from an exported model (suggest.py), the app (app.py)."""
