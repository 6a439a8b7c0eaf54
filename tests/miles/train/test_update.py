"""miles.train.update.train_on_rollout on a one-parameter policy whose gradient is worked out by hand."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pyarrow as pa
import pytest
import torch
from transformers import PretrainedConfig

from miles.config import load_config
from miles.registry import ALGORITHMS
from miles.rollout.schema import ROLLOUT_SCHEMA
from miles.train.algorithms import Algorithm
from miles.train.update import token_advantages, train_on_rollout, with_kl_reward_coef
from tests.helpers import small_llama

OLD_LOGPROB, ROLLOUT_LOGPROB = -1.0, -1.2


class OneTokenHead(torch.nn.Module):
    """An output head over a vocabulary of two whose logits are [theta * h, 0]."""

    out_features = 2

    def __init__(self, theta: float):
        super().__init__()
        self.theta = torch.nn.Parameter(torch.tensor(theta, dtype=torch.float64))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([hidden * self.theta, torch.zeros_like(hidden)], dim=-1)


class OneTokenPolicy(torch.nn.Module):
    """Logits [theta, 0] at every position: log p(token 0) = log sigmoid(theta). They come from an output head over a
    constant hidden state, as a causal LM's do."""

    def __init__(self, logprob: float):
        super().__init__()
        p = math.exp(logprob)
        self.config = PretrainedConfig()
        self.head = OneTokenHead(math.log(p / (1 - p)))

    def get_output_embeddings(self) -> OneTokenHead:
        return self.head

    def forward(self, input_ids, attention_mask):
        return SimpleNamespace(logits=self.head(torch.ones(*input_ids.shape, 1, dtype=torch.float64)))


def _one_token_rollout(advantage: float) -> pa.Table:
    """Prompt [1], response [0] sampled by the engine with log-prob ROLLOUT_LOGPROB."""
    columns = {
        "rollout_id": [0],
        "sample_index": [0],
        "group_index": [0],
        "adapter": [None],
        "prompt_ids": [[1]],
        "response_ids": [[0]],
        "response_length": [1],
        "rollout_logprobs": [[ROLLOUT_LOGPROB]],
        "loss_mask": [[1]],
        "raw_reward": [1.0],
        "advantage": [advantage],
        "status": ["completed"],
        "weight_version": [0],
        "label": [""],
        "prompt": ["p"],
        "num_turns": [1],
        "end_reason": ["done"],
        "weight_versions": [[0]],
        "token_rewards": [None],
        "baseline_reward": [None],
    }
    return pa.table(columns, schema=ROLLOUT_SCHEMA)


def _logprob_gradient(*overrides: str) -> float:
    """dL/d log pi(token) at log pi = OLD_LOGPROB (the current policy is the old one), advantage 1; float32 log-probs."""
    config = load_config(
        None,
        [
            "rollout.rollout_batch_size=1",
            "rollout.n_samples_per_prompt=1",
            "train.global_batch_size=1",
            "train.micro_batch_size=1",
            "algo.eps_clip_high=0.3",  # ratio exp(0.2) = 1.2214 stays inside the clip range
            *overrides,
        ],
    )
    policy = OneTokenPolicy(OLD_LOGPROB)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)
    train_on_rollout(
        policy, optimizer, list(policy.parameters()), _one_token_rollout(1.0), config, torch.device("cpu"), 1
    )
    # d log sigmoid(theta) / d theta = 1 - sigmoid(theta) = 1 - exp(OLD_LOGPROB)
    return float(policy.head.theta.grad) / (1 - math.exp(OLD_LOGPROB))


def test_rollout_logprobs_as_old_policy_are_not_corrected_twice():
    # Old policy = rollout policy: L = -A pi_theta / pi_rollout, dL/dlogp = -exp(-1.0 + 1.2) = -1.2214. A TIS
    # weight pi_old / pi_rollout on top would make it -1.2214 * 1.2214 = -1.4918.
    gradient = _logprob_gradient("algo.use_rollout_logprobs=true", "algo.use_tis=true")
    assert gradient == pytest.approx(-math.exp(0.2), abs=1e-6)


def test_recomputed_old_policy_is_corrected_by_the_tis_weight():
    # Old policy = the trainer's recompute (-1.0): ratio 1, dL/dlogp = -A * 1 * w, w = exp(-1.0 + 1.2) = 1.2214:
    # the same correction as the rollout-log-prob path above.
    assert _logprob_gradient("algo.use_tis=true") == pytest.approx(-math.exp(0.2), abs=1e-6)
    assert _logprob_gradient("algo.use_tis=false") == pytest.approx(-1.0, abs=1e-6)


@pytest.mark.parametrize("policy_loss", sorted(ALGORITHMS["policy_loss"]))
def test_every_policy_loss_trains_with_the_policy_gradient_at_the_old_policy(policy_loss):
    # At r = 1 (and one token, whose covariance is 0: no clip_cov cut, no kl_cov penalty slope) every built-in
    # loss's gradient is REINFORCE's: dL/dlogp = -A = -1.
    assert _logprob_gradient("algo.use_tis=false", f"algo.policy_loss={policy_loss}") == pytest.approx(-1.0, abs=1e-6)


def test_rejection_leaves_a_token_out_of_the_gradient_when_the_gap_exceeds_the_threshold():
    # d = log pi_old - log pi_rollout = -1.0 + 1.2 = 0.2 on the one token: k1 gap 0.2
    reject = ["algo.use_tis=false", "algo.rejection_level=token", "algo.rejection_estimator=k1"]
    assert _logprob_gradient(*reject, "algo.rejection_threshold=0.1") == 0.0
    assert _logprob_gradient(*reject, "algo.rejection_threshold=0.3") == pytest.approx(-1.0, abs=1e-6)


def test_masked_tis_drops_a_token_out_of_band():
    # w = 1.2214 is above tis_clip=1.1: clamp mode gives 1.1, mask mode gives 0.
    assert _logprob_gradient("algo.tis_clip=1.1") == pytest.approx(-1.1, abs=1e-6)
    assert _logprob_gradient("algo.tis_clip=1.1", "algo.tis_mode=mask") == 0.0


def test_kl_in_reward_adds_the_penalty_return_to_go():
    algo = load_config(None, ["algo.kl_in_reward=true", "algo.kl_reward_coef=0.1", "algo.kl_estimator=k1"]).algo
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    old = torch.tensor([[0.0, -1.0, -2.0, -0.5], [0.0, -0.3, -0.7, 0.0]], dtype=torch.float64)
    ref = torch.tensor([[0.0, -1.5, -1.0, -0.5], [0.0, -0.1, -0.2, 0.0]], dtype=torch.float64)
    # k1 = old - ref, masked: [[0, 0.5, -1, 0], [0, -0.2, -0.5, 0]]
    # return to go (sum over t' >= t): [[-0.5, -0.5, -1, 0], [-0.7, -0.7, -0.5, 0]]
    # advantage - 0.1 * return to go, with advantages [1, -2]:
    expected = torch.tensor([[1.05, 1.05, 1.1, 1.0], [-1.93, -1.93, -1.95, -2.0]], dtype=torch.float64)
    out, penalty = token_advantages(
        torch.tensor([1.0, -2.0], dtype=torch.float64), mask, algo, Algorithm.from_config(algo), old, ref
    )
    torch.testing.assert_close(out * mask, expected * mask)
    torch.testing.assert_close(penalty, torch.tensor([[0, 0.5, -1, 0], [0, -0.2, -0.5, 0]], dtype=torch.float64))


def test_with_a_critic_the_penalty_is_discounted_by_gamma_lambda_onto_gaes_token_advantages():
    overrides = ["algo.advantage_estimator=gae", "algo.gamma=0.5", "algo.lam=1.0", "algo.kl_in_reward=true"]
    algo = load_config(None, [*overrides, "algo.kl_reward_coef=0.1", "algo.kl_estimator=k1"]).algo
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    old = torch.tensor([[0.0, -1.0, -2.0, -0.5], [0.0, -0.3, -0.7, 0.0]], dtype=torch.float64)
    ref = torch.tensor([[0.0, -1.5, -1.0, -0.5], [0.0, -0.1, -0.2, 0.0]], dtype=torch.float64)
    gae_advantages = torch.tensor([[0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    # k1 masked: [[0, 0.5, -1, 0], [0, -0.2, -0.5, 0]]; return to go discounted by 0.5:
    # [[-, 0.5 + 0.5 * -1, -1, 0], [-, -0.2 + 0.5 * -0.5, -0.5, -]] = [[-, 0, -1, 0], [-, -0.45, -0.5, -]]
    expected = torch.tensor([[0.0, 1.0, 2.1, 3.0], [0.0, 1.045, 1.05, 0.0]], dtype=torch.float64)
    out, _ = token_advantages(gae_advantages, mask, algo, Algorithm.from_config(algo), old, ref)
    torch.testing.assert_close(out * mask, expected * mask)


def test_kl_penalty_leaves_advantages_alone_without_kl_in_reward():
    algo = load_config(None).algo
    mask = torch.ones(1, 3, dtype=torch.float64)
    out, penalty = token_advantages(
        torch.tensor([0.5], dtype=torch.float64), mask, algo, Algorithm.from_config(algo), None, None
    )
    torch.testing.assert_close(out, torch.full((1, 3), 0.5, dtype=torch.float64))
    assert penalty is None


def test_the_adaptive_kl_coefficient_of_a_rollout_follows_the_kl_measured_before_it():
    overrides = ["algo.kl_in_reward=true", "algo.kl_reward_coef=0.1", "algo.kl_reward_target=0.02"]
    config = load_config(None, overrides)
    # KL 0.03 (error clipped to 0.2): x1.02; KL 0.01 (error -0.5, clipped to -0.2): x0.98; rollout 5 is later
    trained = {0: {"kl_in_reward": 0.03}, 1: {"kl_in_reward": 0.01}, 5: {"kl_in_reward": 9.0}}
    assert with_kl_reward_coef(config, trained, 0).algo.kl_reward_coef == pytest.approx(0.1)
    assert with_kl_reward_coef(config, trained, 1).algo.kl_reward_coef == pytest.approx(0.102)
    assert with_kl_reward_coef(config, trained, 2).algo.kl_reward_coef == pytest.approx(0.102 * 0.98)
    fixed = load_config(None, overrides[:2])
    assert with_kl_reward_coef(fixed, trained, 2) is fixed


def _episode_table(tokenizer, response: str, mask: list[int], env_logprob: float) -> pa.Table:
    """One episode of prompt "1+2=" whose response tokens (one per character) carry `mask`: log-prob -1 on model
    tokens, `env_logprob` on environment tokens."""
    ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(mask)
    columns = {
        "rollout_id": [0, 0],
        "sample_index": [0, 1],
        "group_index": [0, 0],
        "adapter": [None, None],
        "prompt_ids": [tokenizer("1+2=")["input_ids"]] * 2,
        "response_ids": [ids, ids[:2]],
        "response_length": [len(ids), 2],
        "rollout_logprobs": [[-1.0 if m else env_logprob for m in mask], [-1.0, -1.0]],
        "loss_mask": [mask, [1, 1]],
        "raw_reward": [1.0, 0.0],
        "advantage": [1.0, -1.0],
        "status": ["completed", "completed"],
        "weight_version": [0, 0],
        "label": ["", ""],
        "prompt": ["1+2=", "1+2="],
        "num_turns": [2, 1],
        "end_reason": ["done", "done"],
        "weight_versions": [[0] * len(ids), [0, 0]],
        "token_rewards": [None, None],
        "baseline_reward": [None, None],
    }
    return pa.table(columns, schema=ROLLOUT_SCHEMA)


@pytest.mark.parametrize(
    "aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
)
def test_environment_tokens_leave_the_loss_and_the_gradient_alone(tiny_model_dir, tokenizer, aggregation):
    """Environment tokens (loss mask 0) are context only: their ids after the last model token, and their log-probs
    anywhere, change neither the loss nor the gradient (policy loss, KL to the reference, entropy, TIS and
    aggregation alike); the same change on model tokens does."""
    from transformers import AutoModelForCausalLM

    config = load_config(
        None,
        [
            "rollout.rollout_batch_size=1",
            "rollout.n_samples_per_prompt=2",
            "train.global_batch_size=2",
            "train.micro_batch_size=2",
            "algo.entropy_coef=0.01",
            "algo.use_kl_loss=true",
            "algo.kl_loss_coef=0.1",
            f"algo.loss_aggregation={aggregation}",
        ],
    )

    def reference(batch):  # a reference policy that puts log-prob -2 on every token
        return torch.full_like(batch.rollout_logprobs, -2.0)

    def gradient(response: str, mask: list[int], env_logprob: float) -> tuple[float, dict[str, torch.Tensor]]:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        table = _episode_table(tokenizer, response, mask, env_logprob)
        metrics = train_on_rollout(
            model, optimizer, list(model.parameters()), table, config, torch.device("cpu"), 0, reference
        )
        return metrics["loss"], {name: p.grad.clone() for name, p in model.named_parameters()}

    # model "3<eos>"-like turn, the environment's "4+5=", the model's "9", the environment's trailing "77"
    mask = [1, 0, 0, 0, 0, 1, 0, 0]
    loss, grads = gradient("34+5=977", mask, env_logprob=0.0)
    for response, env_logprob in (("34+5=912", 0.0), ("34+5=977", -7.5)):
        other_loss, other = gradient(response, mask, env_logprob)
        assert other_loss == loss
        assert all(torch.equal(grads[name], other[name]) for name in grads)
    changed_loss, changed = gradient("34+5=977", [1, 0, 0, 0, 0, 1, 1, 0], env_logprob=0.0)
    assert changed_loss != loss and any(not torch.equal(grads[n], changed[n]) for n in grads)


def test_old_and_reference_logprobs_come_from_an_eval_forward():
    """A model with dropout: batch_logprobs is the eval-mode forward (the same twice, though the model trains), and
    leaves the model in the mode it found it in; the old policy of every row then comes from it."""
    from miles.train.batch import TrainBatch
    from miles.train.update import batch_logprobs, dropout_active, policy_logprobs

    model = small_llama(vocab=20, attention_dropout=0.5).train()
    assert dropout_active(model) and not dropout_active(small_llama(vocab=20))
    tokens = torch.randint(20, (4, 12), generator=torch.Generator().manual_seed(0))
    ones = torch.ones_like(tokens)
    batch = TrainBatch(tokens, ones, ones.bool(), torch.zeros(4, 12), torch.zeros(4))
    config = load_config(None, ["algo.use_rollout_logprobs=true"])
    first, second = (batch_logprobs(model, batch, config, torch.device("cpu")) for _ in range(2))
    assert model.training and torch.equal(first, second)
    with torch.no_grad():
        model.eval()
        expected = torch.log_softmax(model(input_ids=tokens).logits[:, :-1], dim=-1)
        model.train()
    torch.testing.assert_close(first[:, 1:], expected.gather(-1, tokens[:, 1:, None]).squeeze(-1))
    # the first global batch's old log-probs are not taken from its (dropped-out) training forward
    logprobs = policy_logprobs(model, batch, 2, config, torch.device("cpu"), None)
    assert not logprobs.old_from_training and torch.equal(logprobs.old, first)
