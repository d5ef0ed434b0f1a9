"""Helpers and fakes shared by the tests (no tests here): `wait` (waiting on a condition with a
deadline), `http` (the real server driven by hand-made phones), `fake_server` (a small fake
federation server for the phone's client and the fleet), `keyboard` (exports and a threaded
uvicorn for the web keyboard)."""
