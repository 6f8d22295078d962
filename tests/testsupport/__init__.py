"""Helpers shared by the test folders (imported as `testsupport`: tests/ is on the path through
its conftest). A helper that more than one folder, or more than one test module, uses lives here;
no test module imports another, and nothing edits `sys.path`.

- `fakecluster`: `FakeCluster`, the one fake API server of the unit tests.
- `participants`: `FakeParticipant`, an in-process participant (unit and adversarial tests).
- `delegating`: `Delegating`, a participant client that passes every call to the one it wraps,
  the base of the unit tests' spies and journals and of bench/protocol_pause.py's timings.
- `policy`: the checkpoint policy's pass over a `FakeCluster` (`Run`) and the set it runs on
  (`rollout_set`, `seeded`): unit tests of the policy and adversarial tests of status and spec.
- `setplan`: builders for planning an attempt's pods without a cluster (set plan and InPlace
  unit tests).
- `checkpointflow`: a set and its checkpoint on a `FakeCluster` and a participant that never
  parks, for the unit tests of the checkpoint flow (eviction deadlines, checkpoint slots).
- `server_processes`: real rollout server processes on loopback and helpers to drive them
  (protocol tests, adversarial HTTP tests, bench/engine_relay.py).
- `gym_processes`: NeMo Gym's servers and the Gym adapter as processes on the Gym environment's
  interpreter (`make gym-venv`), and dataset rows for Gym's stateful counter (the adapter's
  protocol tests and its e2e test, docs/gym.md).
- `operator_fixtures`: the operator as a process and the custom resources of a test namespace
  (e2e and adversarial tests); its fixtures are a plugin that `tests/conftest.py` registers with
  `pytest_plugins`.
- `s3_server`: a real S3 server on loopback (`make s3-server`) and a fresh bucket per test, for
  the object-storage tests of every folder; its fixtures are a plugin too.
"""
