"""The libraries' notices that leaked on resume, in the converter and in held-out evaluation
(Megatron's "Apex is not installed", torch's deprecations of what Megatron's checkpointing calls)
are hidden by ``quiet_libraries``; a warning of ours still shows."""

import warnings


def _seen(emit) -> list[str]:
    from megatron_darl.quiet import quiet_libraries

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_libraries()  # its filters go in front of "always"
        emit()
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def test_checkpoint_deprecations_and_apex_notices_are_hidden_ours_are_not(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    def emit():
        try:  # the deprecated call itself, as Megatron's dist_checkpointing makes it on every load
            dcp.load_state_dict({"w": torch.zeros(2)}, storage_reader=dcp.FileSystemReader(str(tmp_path)))
        except Exception:  # noqa: BLE001 (an empty dir is no checkpoint: only the warning matters)
            pass
        # the same texts, from the frames that raise them on CPU
        warnings.warn_explicit("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning,
                               "cpu_compat.py", 54, module="megatron_darl.trainer.cpu_compat")
        warnings.warn_explicit("Apex is not installed. Falling back to Torch Norm", UserWarning,
                               "backends.py", 21, module="megatron.core.models.backends")
        warnings.warn_explicit("replay.k=1 keeps no history", UserWarning, "x.py", 1, module="megatron_darl.loop")

    seen = _seen(emit)
    assert seen == ["UserWarning: replay.k=1 keeps no history"], seen


def test_without_the_filters_the_deprecation_does_show(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            dcp.load_state_dict({"w": torch.zeros(2)}, storage_reader=dcp.FileSystemReader(str(tmp_path)))
        except Exception:  # noqa: BLE001
            pass
    assert any(issubclass(w.category, FutureWarning) and "load_state_dict" in str(w.message) for w in caught)
