"""The algo section: the RL algorithm by name (docs/algorithms.md: each option, its formula and its paper)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from miles.config.base import IMPORT_PATH, Section, mid_run
from miles.registry import check_algorithm_name


class AlgoConfig(Section):
    """The RL algorithm, by name (docs/algorithms.md: each option, its formula and its paper)."""

    advantage_estimator: str = Field(
        "grpo",
        json_schema_extra=IMPORT_PATH,
        description="grpo, dr_grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_sample, "
        "reinforce_plus_plus_baseline, gpg, opo, remax (a greedy response per prompt as the baseline), gae (PPO's, "
        "with a critic: the critic section), or 'pkg.mod:fn'",
    )
    gamma: float = Field(1.0, ge=0, le=1, description="gae: the discount per token")
    lam: float = Field(1.0, ge=0, le=1, description="gae: lambda, the bias/variance trade-off of the estimate")
    policy_loss: str = Field(
        "ppo_clip",
        json_schema_extra=IMPORT_PATH,
        description="ppo_clip, gspo, cispo, gpg, geo_mean, sapo, clip_cov, kl_cov, or 'pkg.mod:fn'",
    )
    loss_aggregation: str | None = Field(
        None,
        json_schema_extra=IMPORT_PATH,
        description="token_mean, token_sum, seq_mean_token_sum, seq_mean_token_mean, seq_mean_token_sum_norm, or "
        "'pkg.mod:fn'; unset: the method's own (gspo, geo_mean, sapo: seq_mean_token_mean, else dr_grpo: "
        "seq_mean_token_sum_norm, else token_mean)",
    )
    eps_clip: float = Field(0.2, gt=0, description="lower clip of the ratio: 1 - eps_clip")
    eps_clip_high: float | None = Field(None, gt=0, description="upper clip: 1 + eps_clip_high; unset: eps_clip")
    clip_ratio_c: float | None = Field(
        None, gt=1, description="ppo_clip's dual clip: a negative-advantage token's loss is at most -c A; unset: off"
    )
    sapo_tau_pos: float = Field(1.0, gt=0, description="sapo's gate temperature where the advantage is positive")
    sapo_tau_neg: float = Field(1.05, gt=0, description="sapo's gate temperature where it is not")
    clip_cov_ratio: float = Field(2e-4, gt=0, le=1, description="clip_cov: the share of tokens whose gradient is cut")
    clip_cov_lb: float = Field(1.0, description="clip_cov: the covariance above which a token may be cut")
    clip_cov_ub: float = Field(5.0, description="clip_cov: the covariance below which a token may be cut")
    kl_cov_ratio: float = Field(2e-4, gt=0, le=1, description="kl_cov: the share of tokens that get the penalty")
    kl_cov_coef: float = Field(1.0, ge=0, description="kl_cov: the weight of |log r| on those tokens")
    kl_estimator: str = Field(
        "k3",
        json_schema_extra=IMPORT_PATH,
        description="k1, k2 (mse), k3 (low_var_kl), abs, k1+, k3+ (straight-through: k2's gradient), or 'pkg.mod:fn'",
    )
    use_kl_loss: bool = Field(False, description="KL to the starting policy as a loss term, weighted kl_loss_coef")
    kl_loss_coef: float = Field(
        0.0, ge=0, description="the weight of the KL loss (use_kl_loss)", json_schema_extra=mid_run("kl_loss_coef")
    )
    kl_in_reward: bool = Field(
        False, description="KL to the starting policy as a per-token reward penalty, weighted kl_reward_coef"
    )
    kl_reward_coef: float = Field(0.0, ge=0, description="the KL-in-reward weight (the start, when adaptive)")
    kl_reward_target: float | None = Field(
        None, gt=0, description="adaptive KL control: the per-token KL the coefficient steers to; unset: fixed"
    )
    kl_reward_gain: float = Field(0.1, gt=0, description="adaptive KL control: the controller's gain (K_beta)")
    entropy_coef: float = Field(
        0.0, ge=0, description="the weight of the entropy bonus", json_schema_extra=mid_run("entropy_coef")
    )
    use_rollout_logprobs: bool = Field(
        False, description="engine log-probs as the old policy instead of a recompute (then no TIS weight applies)"
    )
    use_tis: bool = Field(
        True, description="weight each token's loss by the bounded ratio trainer_old / rollout (off-policy correction)"
    )
    tis_level: Literal["token", "sequence"] = Field("token", description="one ratio per token, or per sample")
    tis_mode: Literal["clamp", "mask"] = Field(
        "clamp", description="a ratio outside [tis_clip_low, tis_clip] is clamped to the bound, or masked to 0"
    )
    tis_clip: float = Field(2.0, gt=0, description="upper bound of the TIS weight")
    tis_clip_low: float = Field(0.0, ge=0, description="lower bound of the TIS weight")
    rejection_level: Literal["off", "token", "sequence"] = Field(
        "off",
        description="leave out of the loss each token (token), or each sample (sequence: the mean over its tokens), "
        "whose engine/trainer gap rejection_estimator exceeds rejection_threshold",
    )
    rejection_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="the gap per token, from d = log pi_old - log pi_rollout: k1 |d|, k2 d^2/2, k3 exp(-d)+d-1"
    )
    rejection_threshold: float = Field(0.01, gt=0, description="the largest gap kept")
    dynamic_sampling: bool = Field(
        False,
        description="DAPO: leave out groups whose rewards are all equal; generate more rounds (up to "
        "rollout.max_generate_rounds) until rollout_batch_size groups differ",
    )
    overlong_buffer_len: int | None = Field(
        None, gt=0, description="DAPO's soft overlong punishment over the last N tokens of max_new_tokens; unset: off"
    )
    overlong_penalty: float = Field(1.0, ge=0, description="the reward taken off a response of max_new_tokens")

    @field_validator("advantage_estimator", "policy_loss", "loss_aggregation", "kl_estimator")
    @classmethod
    def _known_name(cls, name: str | None, info: ValidationInfo) -> str | None:
        return name if name is None else check_algorithm_name(info.field_name, name)

    @model_validator(mode="after")
    def _consistent(self) -> AlgoConfig:
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(f"clip_cov_lb ({self.clip_cov_lb}) must be below clip_cov_ub ({self.clip_cov_ub})")
        if self.rejection_level != "off" and self.use_rollout_logprobs:
            raise ValueError(
                "rejection_level needs the trainer's own old log-probs to measure the gap: set use_rollout_logprobs "
                "to false, or rejection_level to off"
            )
        return self

    @property
    def aggregation(self) -> str:
        """The loss aggregation in effect: the configured one, else the method's own."""
        if self.loss_aggregation is not None:
            return self.loss_aggregation
        if self.policy_loss in ("gspo", "geo_mean", "sapo"):
            return "seq_mean_token_mean"
        if self.advantage_estimator == "dr_grpo":
            return "seq_mean_token_sum_norm"
        return "token_mean"

    @property
    def needs_reference(self) -> bool:
        """Whether the trainer holds the starting policy as a frozen reference."""
        return self.use_kl_loss or self.kl_in_reward

    @property
    def corrects_off_policy(self) -> bool:
        """Whether the loss is weighted by trainer_old / rollout: with rollout log-probs as the old policy the PPO
        ratio is pi_theta / pi_rollout already, and a weight would correct twice."""
        return self.use_tis and not self.use_rollout_logprobs
