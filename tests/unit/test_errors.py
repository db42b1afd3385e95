import inspect

import rollout
from rollout.chat import ChatError
from trainer_bridge import CheckpointError, SyncError


def test_each_error_the_package_raises_on_purpose_is_a_rollout_error():
    exported = [getattr(rollout, name) for name in rollout.__all__]
    errors = [kind for kind in exported if inspect.isclass(kind) and issubclass(kind, BaseException)]
    # Raised by the import itself, before there is a worker (and by `make`, run as a script).
    outside = {rollout.UnsupportedVersionError}
    assert {kind for kind in errors if not issubclass(kind, rollout.RolloutError)} == outside
    assert issubclass(ChatError, rollout.RolloutError) and issubclass(ChatError, ValueError)
    # The builtins they replaced still catch them.
    assert issubclass(rollout.EngineError, RuntimeError) and issubclass(rollout.PodError, RuntimeError)
    # A pod's failed sync is both: the pod's error and the tree's.
    assert issubclass(rollout.PeerSyncError, rollout.RolloutError) and issubclass(rollout.PeerSyncError, SyncError)
    assert not issubclass(SyncError, rollout.RolloutError) and not issubclass(CheckpointError, rollout.RolloutError)
