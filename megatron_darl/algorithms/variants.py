"""The one call the loop makes per batch: the behavior side of a selected batch.

Every variant is the same code path with a different ``VariantSpec`` (``spec.py``: which score
ranks the buffer, which weight rule corrects for the behavior policy, which log-probs the PPO
ratio is taken against). ``batch_behavior_weights`` turns a selected batch into the per-token
weights and ratio base that ``policy_loss`` takes, so the training loop never branches on the
variant.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_darl.algorithms.importance import (
    behavior_weights, capped_tokens, mixture_log_density, prefix_mixture_log_density, version_alpha,
)
from megatron_darl.algorithms.spec import (
    CapMode, MixtureForm, RatioBase, Variant, VariantSpec, WeightRule, variant_spec,
)


@dataclass(frozen=True)
class BatchWeights:
    """What ``policy_loss`` needs from the behavior side of a selected batch."""

    weights: torch.Tensor  # (N, T) or packed (n,) float32 behavior weights w_ij (0 where masked), detached
    logp_base: torch.Tensor  # like weights: log-probs the PPO ratio is taken against, detached
    alpha: torch.Tensor  # (K,) float64 token share of each version in the batch
    capped: torch.Tensor | None = None  # like weights, bool: tokens whose ratio exceeded the cap


def _validate_batch(
    logp_current: torch.Tensor,
    logp_by_version: torch.Tensor,
    versions: torch.Tensor,
    behavior_version: torch.Tensor,
    mask: torch.Tensor,
) -> None:
    shape = tuple(logp_current.shape)  # (N, T) padded rows or (n,) packed tokens
    if logp_current.dim() not in (1, 2) or tuple(logp_by_version.shape[1:]) != shape:
        raise ValueError(
            f"logp_by_version must be (K, *{shape}) for logp_current {shape} (padded (N, T) or "
            f"packed (n,)), got shape {tuple(logp_by_version.shape)}"
        )
    if tuple(mask.shape) != shape:
        raise ValueError(f"mask {tuple(mask.shape)} must match logp_current {shape}")
    k = logp_by_version.shape[0]
    if versions.shape != (k,) or behavior_version.shape != shape[:1]:
        raise ValueError(f"versions must be ({k},) and behavior_version ({shape[0]},)")
    if torch.unique(versions).numel() != k:
        raise ValueError(f"versions must be distinct, got {versions.tolist()}")


def _own_rows(
    logp_by_version: torch.Tensor, versions: torch.Tensor, behavior_version: torch.Tensor
) -> torch.Tensor:
    """Each row's own behavior version out of ``(K, N, ...)``: ``(N, ...)``."""
    order = torch.argsort(versions)
    pos = torch.searchsorted(versions[order], behavior_version).clamp(max=versions.numel() - 1)
    k_of_row = order[pos]  # (N,) index of each row's version in ``versions``
    found = versions[k_of_row] == behavior_version
    if not bool(found.all()):
        missing = sorted(set(behavior_version[~found].tolist()))
        raise ValueError(f"behavior versions {missing} are not in versions {versions.tolist()}")
    index = k_of_row.to(logp_by_version.device).view(1, -1, *([1] * (logp_by_version.dim() - 2)))
    return logp_by_version.gather(0, index.expand(1, *logp_by_version.shape[1:]))[0]


def batch_behavior_weights(
    variant: Variant | str | VariantSpec,
    logp_current: torch.Tensor,
    logp_by_version: torch.Tensor,
    versions: torch.Tensor,
    behavior_version: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = 2.0,
    version_tokens: torch.Tensor | None = None,
    cap_mode: CapMode | str = CapMode.CLIP,
    form: MixtureForm | str = MixtureForm.PREFIX,
    sample_index: torch.Tensor | None = None,
    posterior_by_version: torch.Tensor | None = None,
) -> BatchWeights:
    """Per-token behavior weights and PPO ratio base of a selected batch for ``variant``.

    Args:
        variant: a ``Variant``, its name, or a ``VariantSpec``.
        logp_current: ``(N, T)`` trainer log pi_t (the proximal log-probs); or the packed layout
            ``(n,)``, every token of the batch end to end (then every other per-token argument
            is packed the same way and ``behavior_version`` is given per token).
        logp_by_version: ``(K, N, T)`` (packed: ``(K, n)``) log pi_k for each ``versions[k]``;
            the row of a sample's own behavior version must hold the engine's log-probs. Only
            the own rows are read unless the rule is ``mixture``; then every version with
            tokens must be finite at unmasked positions (backfill the cache first).
        versions: ``(K,)`` int64 version of each row of ``logp_by_version``.
        behavior_version: ``(N,)`` (packed: ``(n,)``) int64 behavior version of each sample or
            token (one of ``versions``).
        mask: response mask of ``logp_current``'s shape (packed: all True but filler).
        clip: truncation c of the weights (``mis.clip``); ``None`` for none.
        version_tokens: ``(K,)`` tokens per version over the whole selected batch, for when the
            batch is split over DP shards (all-reduce the local counts); default: counted here.
        cap_mode: ``"clip"`` truncates weights at ``clip``; ``"mask"`` zeroes tokens above it.
        form: the mixture's conditional for ``mixture`` weights: ``"prefix"`` (the sequence
            mixture's, exact) or ``"token"`` (the mixture of per-token conditionals, an ablation).
        sample_index: packed layout with ``form="prefix"``: ``(n,)`` response of each token.
        posterior_by_version: ``form="prefix"``: rows of ``logp_by_version``'s shape, the
            trainer's for every version (the own version's included), that the mixture's
            posterior over versions reads (one source: ``importance.py``); default:
            ``logp_by_version``. Needed only when two or more versions have tokens.

    Returns:
        ``BatchWeights`` with ``weights`` and ``logp_base`` for ``policy_loss``.
    """
    spec = variant_spec(variant)
    _validate_batch(logp_current, logp_by_version, versions, behavior_version, mask)
    m = mask.bool()
    logp_own = _own_rows(logp_by_version, versions, behavior_version).detach()  # (N, T)
    if version_tokens is None:
        per_sample = m.reshape(m.shape[0], -1).sum(dim=1).to(torch.float64)  # (N,) (packed: 0/1)
        same = (behavior_version[None, :] == versions[:, None]).to(torch.float64)  # (K, N)
        version_tokens = same @ per_sample  # (K,)
    if float(version_tokens.sum()) > 0:
        alpha = version_alpha(version_tokens)  # (K,)
    else:
        alpha = torch.zeros(versions.shape[0], dtype=torch.float64)
    capped = torch.zeros_like(m)
    if spec.weight_rule is WeightRule.NONE or not bool(m.any()):
        weights = m.float()
    else:
        if spec.weight_rule is WeightRule.OWN_BEHAVIOR:
            log_q = logp_own
        else:
            _check_finite(logp_by_version, alpha, m, versions)
            post = None
            if posterior_by_version is not None and int((alpha > 0).sum()) > 1:
                _check_finite(posterior_by_version, alpha, m, versions)
                post = posterior_by_version.detach()
            log_q = _mixture(logp_by_version.detach(), alpha, _form(form), sample_index, m, post)  # (N, T)
        weights = behavior_weights(logp_current, log_q, clip, mask=m, cap_mode=cap_mode)
        capped = capped_tokens(logp_current, log_q, clip, mask=m)
    base = logp_own if spec.ratio_base is RatioBase.BEHAVIOR else logp_current.detach()
    return BatchWeights(weights=weights, logp_base=base, alpha=alpha, capped=capped)


def _form(form: MixtureForm | str) -> MixtureForm:
    try:
        return MixtureForm(form)
    except ValueError:
        raise ValueError(f"mixture form must be one of {[f.value for f in MixtureForm]}, got {form!r}") from None


def _mixture(logp_by_version: torch.Tensor, alpha: torch.Tensor, form: MixtureForm,
             sample_index: torch.Tensor | None, mask: torch.Tensor,
             posterior: torch.Tensor | None = None) -> torch.Tensor:
    """log q of the batch's behavior mixture in ``form`` (the prefix form's posterior reading
    ``posterior`` when given); packed prefix form needs ``sample_index``."""
    if form is MixtureForm.TOKEN:
        return mixture_log_density(logp_by_version, alpha)
    if logp_by_version.dim() == 3:
        return prefix_mixture_log_density(logp_by_version, alpha, mask=mask, posterior_by_version=posterior)
    if sample_index is None:
        raise ValueError("packed mixture weights in the prefix form need sample_index (the response "
                         "of each token); pass form='token' for the per-token mixture")
    return prefix_mixture_log_density(logp_by_version, alpha, sample_index=sample_index,
                                      posterior_by_version=posterior)


def _check_finite(
    logp_by_version: torch.Tensor, alpha: torch.Tensor, m: torch.Tensor, versions: torch.Tensor
) -> None:
    """Raise if a version that enters the mixture has a non-finite log-prob at a real token."""
    zero = torch.zeros((), dtype=logp_by_version.dtype, device=logp_by_version.device)
    for k in torch.nonzero(alpha > 0).flatten().tolist():  # m: (N, T) or packed (n,)
        total = torch.where(m, logp_by_version[k], zero).sum()  # -inf, +inf or NaN poison it
        if not bool(torch.isfinite(total)):
            raise ValueError(
                f"logp_by_version for version {int(versions[k])} is not finite at unmasked "
                "tokens: fill or backfill the log-prob cache for every window version first"
            )
