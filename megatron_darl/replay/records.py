"""``SampleGroup`` <-> plain dict: replay checkpoints load with ``torch.load(weights_only=True)``.

Pickling the dataclasses would tie checkpoints to the class path and need ``weights_only=False``;
plain dicts of tensors and scalars do neither.
"""

from __future__ import annotations

from typing import Any, Mapping

from megatron_darl.samples import Sample, SampleGroup

_TENSOR_FIELDS = ("prompt_ids", "response_ids", "behavior_logprobs", "token_versions")


def sample_to_state(sample: Sample) -> dict[str, Any]:
    state: dict[str, Any] = {name: getattr(sample, name).clone() for name in _TENSOR_FIELDS}
    state.update(sample_id=sample.sample_id, reward=float(sample.reward),
                 truncated=bool(sample.truncated))
    return state


def sample_from_state(state: Mapping[str, Any]) -> Sample:
    return Sample(
        sample_id=int(state["sample_id"]),
        reward=float(state["reward"]),
        truncated=bool(state["truncated"]),
        **{name: state[name].clone() for name in _TENSOR_FIELDS},
    )


def group_to_state(group: SampleGroup) -> dict[str, Any]:
    return {
        "group_id": group.group_id,
        "prompt_id": group.prompt_id,
        "worker_id": group.worker_id,
        "worker_index": group.worker_index,
        "samples": [sample_to_state(s) for s in group.samples],
    }


def group_from_state(state: Mapping[str, Any]) -> SampleGroup:
    return SampleGroup(
        group_id=int(state["group_id"]),
        prompt_id=int(state["prompt_id"]),
        worker_id=int(state["worker_id"]),
        worker_index=int(state.get("worker_index", -1)),  # absent in checkpoints before frame format 2
        samples=[sample_from_state(s) for s in state["samples"]],
    )
