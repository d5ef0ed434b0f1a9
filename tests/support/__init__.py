"""fedkey.testing: the helpers and fakes that fedkey's tests and its research harness share (no
tests here; in a checkout only, not in the wheel): `wait` (waiting on a condition with a deadline),
`http` (the real server driven by hand-made phones), `fake_server` (a small fake federation server
for the phone's client and the fleet), `keyboard` (exports and a threaded uvicorn for the web
keyboard), `postgres` (a throwaway PostgreSQL cluster), `browser` (Debian's Chromium for
Playwright), `tls` (a self-signed certificate), `federation` and `workload` (small runs),
`pretrain` (a small Chit-Chat dataset and a tiny base model)."""
