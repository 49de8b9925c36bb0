"""The paper's title as a test: the model run token by token through its recurrent twins
gives the same outputs as its parallel forward."""
import pytest
import torch
from hydra.utils import instantiate

from repro.config import compose_group
from repro.models import AutoregressiveTransformer, Transformer, sinusoid


def _model(name, norm_first=False, dtype=torch.float64):
    att = instantiate(compose_group("attention", name))
    model = AutoregressiveTransformer(att, n_tokens=11, d_out=5, n_layers=3, d_model=32, n_heads=4,
                                      d_ff=48, dropout=0.1, norm_first=norm_first)
    return model.to(dtype).eval()  # eval: dropout off, as in generation


@pytest.mark.parametrize("name", ["softmax", "linear"])
@pytest.mark.parametrize("norm_first", [False, True])
def test_step_outputs_equal_parallel_forward(name, norm_first):
    model = _model(name, norm_first)
    tokens = torch.randint(0, 11, (3, 29))
    parallel = model(tokens)
    state, steps = None, []
    for t in range(tokens.shape[1]):
        y, state = model.step(tokens[:, t], state)
        steps.append(y)
    assert state.position == 29
    torch.testing.assert_close(torch.stack(steps, 1), parallel, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", ["softmax", "linear"])
def test_model_is_causal(name):
    model = _model(name)
    tokens = torch.randint(0, 11, (2, 20))
    j = 12
    changed = tokens.clone()
    changed[:, j] = (changed[:, j] + 1) % 11
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :j], b[:, :j])
    assert (a[:, j] - b[:, j]).abs().max() > 1e-6  # and the change does reach position j


def test_model_trains_end_to_end():
    model = _model("linear", dtype=torch.float32).train()
    tokens = torch.randint(0, 11, (4, 16))
    out = model(tokens)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_encoder_non_causal_sees_the_future():
    att = instantiate(compose_group("attention", "linear"))
    enc = Transformer(att, n_layers=2, d_model=16, n_heads=2, d_ff=32, dropout=0.0).eval()
    x = torch.randn(1, 10, 16)
    x2 = x.clone()
    x2[0, -1] += 1
    assert (enc(x)[0, 0] - enc(x2)[0, 0]).abs().max() > 1e-6
    torch.testing.assert_close(enc(x, causal=True)[0, :-1], enc(x2, causal=True)[0, :-1])


def test_sinusoid_matches_formula():
    pos = torch.tensor([0, 3, 17])
    enc = sinusoid(pos, 6)
    for r, p in enumerate(pos.tolist()):
        for i in range(3):
            angle = p / 10000 ** (2 * i / 6)
            assert enc[r, 2 * i].item() == pytest.approx(torch.sin(torch.tensor(angle)).item(), abs=1e-6)
            assert enc[r, 2 * i + 1].item() == pytest.approx(torch.cos(torch.tensor(angle)).item(), abs=1e-6)


def test_unknown_activation_is_named():
    with pytest.raises(ValueError, match="unknown activation 'swish'; valid: relu, gelu"):
        AutoregressiveTransformer(instantiate(compose_group("attention", "linear")), n_tokens=3,
                                  activation="swish", n_layers=1, d_model=8, n_heads=2, d_ff=8)
