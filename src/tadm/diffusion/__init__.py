"""The paper's diffusion math as pure functions on tensors.

Schedules alpha_t, the forward process q(z_t | x) (absorbing and uniform) and z_t -> z_t', reverse
posteriors (MDLM, ReMDM / TADM, uniform-state), per-token losses (masked NELBO, T-ANELBO,
uniform-state NELBO, KD) and training-time sampling of t and the stale anchor time t'.
Depends only on torch.
"""

from tadm.diffusion.forward import PRIORS, forward_marginal, further_mask, mask_corrupt, uniform_corrupt
from tadm.diffusion.losses import (TANELBOTerms, discrete_cached_nelbo, discrete_masked_nelbo, discrete_weight, kd_loss,
                                   masked_diffusion_loss, t_anelbo_loss, usdm_loss)
from tadm.diffusion.posteriors import (REMDM_STRATEGIES, masked_posterior, remdm_move_probs, remdm_move_probs_scalar,
                                       remdm_posterior, remdm_sigma, remdm_sigma_max, reverse_posterior, usdm_posterior)
from tadm.diffusion.schedules import (DEFAULT_SCHEDULE, SCHEDULES, CosineSchedule, LinearSchedule, LogLinearSchedule,
                                      NoiseSchedule, get_schedule)
from tadm.diffusion.time_sampling import StaleAnchorTimes, last_refresh_step, sample_stale_anchor_times, sample_t

__all__ = [
    # schedules
    "NoiseSchedule",
    "LogLinearSchedule",
    "LinearSchedule",
    "CosineSchedule",
    "SCHEDULES",
    "DEFAULT_SCHEDULE",
    "get_schedule",
    # forward process
    "PRIORS",
    "mask_corrupt",
    "uniform_corrupt",
    "further_mask",
    "forward_marginal",
    # posteriors
    "REMDM_STRATEGIES",
    "reverse_posterior",
    "masked_posterior",
    "remdm_sigma_max",
    "remdm_sigma",
    "remdm_move_probs",
    "remdm_move_probs_scalar",
    "remdm_posterior",
    "usdm_posterior",
    # losses
    "discrete_weight",
    "masked_diffusion_loss",
    "TANELBOTerms",
    "t_anelbo_loss",
    "usdm_loss",
    "kd_loss",
    "discrete_masked_nelbo",
    "discrete_cached_nelbo",
    # time sampling
    "sample_t",
    "StaleAnchorTimes",
    "sample_stale_anchor_times",
    "last_refresh_step",
]
