"""Helpers shared by the test folders (imported as `testsupport`: tests/ is on the path through
its conftest): `fakecluster.FakeCluster`, the one fake API server of the unit tests."""
