"""fedkey's tests, mirroring the product's folders. A package, so that a test can import another
test's helpers by name (tests.federation.privacy.test_tree); the helpers several share are
fedkey.testing (tests/support)."""
