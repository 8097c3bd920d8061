"""One rank's step math without Ray: samples as tensors or HuggingFace dicts, ignored labels,
and the rescale that makes a split batch equal the whole batch's mean loss."""

import torch

from elastic.core.data_plan import PADDING_INDEX, token_rescale
from tests.reference import huggingface_loss
from workers.model import ModelArgs, Transformer
from workers.train_step import accumulate_gradients, collate, counted_tokens, token_cross_entropy

SEQ_LEN = 16


class PromptAndAnswer:
    """HuggingFace-style samples: a prompt whose labels are ignored, then the answer."""

    def __init__(self, samples: int, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 256, (samples, SEQ_LEN + 1), generator=generator)
        self.prompt = torch.randint(1, SEQ_LEN, (samples,), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        labels = self.ids[index].clone()
        labels[: self.prompt[index]] = -100
        return {"input_ids": self.ids[index], "labels": labels}


def test_a_dict_sample_trains_only_its_labels_and_a_padding_row_nothing():
    data = PromptAndAnswer(4)
    batch = collate(data, [0, 1, PADDING_INDEX], torch.device("cpu"))
    assert torch.equal(batch.inputs[:2], data.ids[:2, :-1])
    for row in range(2):
        answer = data.prompt[row] - 1  # the first target that counts: the label after the prompt
        assert batch.weights[row, :answer].sum() == 0 and batch.weights[row, answer:].all()
        assert torch.equal(batch.targets[row, answer:], data.ids[row, answer + 1:])
    assert batch.weights[2].sum() == 0
    assert batch.counted_tokens == int(batch.weights.sum()) == sum(SEQ_LEN - data.prompt[row].item() + 1 for row in range(2))
    assert batch.targets.min() >= 0  # a loss_fn is never handed -100


def test_plain_token_samples_count_every_target_and_need_no_rescale():
    samples = [torch.arange(SEQ_LEN + 1) % 256 for _ in range(3)]
    batch = collate(samples, [0, 1, 2, PADDING_INDEX], torch.device("cpu"))
    assert batch.counted_tokens == 3 * SEQ_LEN
    assert torch.equal(batch.targets[:3], torch.stack(samples)[:, 1:])
    assert token_rescale(3 * SEQ_LEN, batch.counted_tokens) == 1.0


def test_shares_of_a_masked_batch_rescaled_give_the_whole_batchs_mean_loss_and_gradient():
    data = PromptAndAnswer(8, seed=1)
    args = ModelArgs(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=4, ffn_hidden=64, max_seq_len=SEQ_LEN)
    torch.manual_seed(0)
    whole, split = Transformer(args), Transformer(args)
    split.load_state_dict(whole.state_dict())
    expected = huggingface_loss(whole, [data[i] for i in range(8)])
    expected.backward()
    # two "ranks" of uneven shares, one with a padding row, each over the global token count
    shares = [[0, 1, 2], [3, 4, 5, 6, 7, PADDING_INDEX]]
    batches = [collate(data, share, torch.device("cpu")) for share in shares]
    global_tokens = 8 * SEQ_LEN
    loss_sum = sum(accumulate_gradients(split, token_cross_entropy, [batch], global_tokens) for batch in batches)
    rescale = token_rescale(global_tokens, counted_tokens(batches))
    assert rescale > 1.0
    assert abs(loss_sum * rescale - expected.item()) <= 1e-6 * expected.item()
    for a, b in zip(whole.parameters(), split.parameters()):
        torch.testing.assert_close(b.grad * rescale, a.grad, rtol=1e-5, atol=1e-7)



def broken_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits, targets, reduction="none")  # (batch, seq, vocab): a user's bug


def test_gradient_buckets_are_consecutive_and_cut_before_they_would_overflow():
    from workers.gradient_sum import plan_buckets

    assert plan_buckets([4, 4, 4, 10, 1], 8) == [[0, 1], [2], [3], [4]]
    assert plan_buckets([4, 4, 4], float("inf")) == [[0, 1, 2]]


def test_a_loss_fn_that_returns_other_than_one_loss_per_target_is_named():
    import pytest

    from workers.train_step import TokenLoss

    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=32, dim=16, n_layers=1, n_heads=2, ffn_hidden=32, max_seq_len=8))
    batch = collate([torch.randint(0, 32, (9,)) for _ in range(2)], [0, 1], torch.device("cpu"))

    def flattened(logits, targets):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")

    with pytest.raises(ValueError, match=r"loss_fn returned losses of shape \(16,\) for targets of shape \(2, 8\): "
                                         r"return one loss per target"):
        TokenLoss(flattened)(model, batch)
