"""torch.optim.AdamW's contract where users do things by hand, family by family (issue 24).

Each family is every way of doing one thing a user does between or inside steps — change the
weights outside the optimizer, interrupt step(), reload the optimizer — and each member is
compared with AdamW doing the same (emulated link and the CUDA order checker, see test_offload).
"""

import copy
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from offloadlab.offload import CPUOffloadAdam
from tests.test_offload import assert_matches, data, mlp


def backward(model, micro):
    for x, y in micro:
        (nn.functional.mse_loss(model(x), y) / len(micro)).backward()


# ---------------------------------------------------------------------- weights edited by hand


def _fill(model, _):
    model[0].weight.data.fill_(0.05)  # the example: AdamW 4.895, ours 0.798


def _copy_from_checkpoint(model, other):
    for p, q in zip(model.parameters(), other.parameters()):
        p.data.copy_(q)


def _ema_restore(model, other):
    for p, q in zip(model.parameters(), other.parameters()):
        p.data.mul_(0.5).add_(q.data, alpha=0.5)


def _no_grad_in_place(model, _):
    with torch.no_grad():
        for p in model.parameters():
            p.clamp_(-0.05, 0.05)


def _assign_data(model, other):
    model[2].weight.data = other[2].weight.detach().clone()


def _model_load_state_dict(model, other):
    model.load_state_dict(other.state_dict())


def _vector_to_parameters(model, other):
    vector = nn.utils.parameters_to_vector(other.parameters())
    nn.utils.vector_to_parameters(vector, model.parameters())


EDITS = {
    "p.data.fill_": _fill,
    "p.data.copy_ from a checkpoint": _copy_from_checkpoint,
    "EMA restore through .data": _ema_restore,
    "no_grad in-place clamp_": _no_grad_in_place,
    "p.data = …": _assign_data,
    "model.load_state_dict": _model_load_state_dict,
    "vector_to_parameters": _vector_to_parameters,
}


def other_weights():
    torch.manual_seed(7)
    return nn.Sequential(
        nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4)
    )


@pytest.mark.parametrize("declared", [None, 2], ids=["at step", "accumulation_steps=2"])
@pytest.mark.parametrize("edit", list(EDITS), ids=list(EDITS))
def test_weights_changed_outside_the_optimizer_are_the_ones_it_updates(link, edit, declared):
    """However a user changes the weights between steps, the next step starts from them, as
    AdamW's does (it used to start from its own fp32 master when the change went through .data)."""
    ref, mine = mlp(), mlp()
    reference = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = CPUOffloadAdam(
        mine.parameters(), lr=1e-2, link=link, accumulation_steps=declared, bucket_bytes=4096
    )
    for step, micro in enumerate(data(6, 2)):
        if step == 3:
            EDITS[edit](ref, other_weights())
            EDITS[edit](mine, other_weights())
        for model, optimizer in ((ref, reference), (mine, opt)):
            optimizer.zero_grad()
            backward(model, micro)
            optimizer.step()
    opt.close()
    assert_matches(ref, mine)


# (a delayed update pending when the weights are changed is dropped for them, and says so)
@pytest.mark.filterwarnings("ignore:CPUOffloadAdam. 1 parameter.s. were changed outside")
@pytest.mark.parametrize("bucket_bytes", [4096, 2**20], ids=["alone in its bucket", "shared"])
@pytest.mark.parametrize("mode", ["at step", "eager", "delayed"])
def test_a_parameter_made_non_contiguous_is_refused_with_its_fix(link, bucket_bytes, mode):
    """``p.data = p.data.t()`` (a square weight: the same memory, other strides) is refused at the
    next step() — and by synchronize() with a delayed update pending — before anything happens,
    as the constructor refuses such a parameter (the eager schedule leaves its bucket to step()
    rather than send it up in backward); once the user makes it contiguous again, training goes
    on as it would have (AdamW, or for a delayed update the same optimizer given the contiguous
    weights at once). Alone in its bucket such a parameter used to close the optimizer with
    torch's view error from inside the update, and its state was lost."""
    delayed = mode == "delayed"
    ref, mine = mlp(), mlp()
    if delayed:
        reference = CPUOffloadAdam(ref.parameters(), lr=1e-2, link=link, delayed_update=True)
    else:
        reference = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = CPUOffloadAdam(
        mine.parameters(),
        lr=1e-2,
        link=link,
        bucket_bytes=bucket_bytes,
        delayed_update=delayed,
        accumulation_steps=2 if mode == "eager" else None,
    )
    for step, micro in enumerate(data(6, 2)):
        if step == 3:
            mine[2].weight.data = mine[2].weight.data.t()
            ref[2].weight.data = ref[2].weight.data.t()
            if delayed:
                ref[2].weight.data = ref[2].weight.data.contiguous()
        for model, optimizer in ((ref, reference), (mine, opt)):
            optimizer.zero_grad()
            backward(model, micro)
            if step == 3 and optimizer is opt:
                with pytest.raises(RuntimeError, match=r"no longer contiguous.*data\.contiguous"):
                    (opt.synchronize if delayed else opt.step)()
                mine[2].weight.data = mine[2].weight.data.contiguous()
            optimizer.step()
    for optimizer in (opt, reference):
        if isinstance(optimizer, CPUOffloadAdam):
            optimizer.close()
    assert_matches(ref, mine)


# ---------------------------------------------------------------------- interrupting step()

# Each stage of the engine's step (and the update worker's hand-over), interrupted on entry or
# on its way out; with accumulation_steps the buckets are handed over during backward.
STAGES = ["_take_in_gradients", "_take_zero_gradients", "_grad_scale", "worker.submit", "_finish"]


def interrupt_once(monkeypatch, engine, stage: str, when: str):
    """Make ``engine``'s ``stage`` raise KeyboardInterrupt at its first call during one step();
    returns a list that records whether it fired."""
    owner, name = (engine.worker, "submit") if stage == "worker.submit" else (engine, stage)
    original, fired = getattr(owner, name), []

    def interrupted(*args, **kwargs):
        if not fired:
            fired.append(stage)
            if when == "on entry":
                raise KeyboardInterrupt
            original(*args, **kwargs)
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, interrupted)
    return fired


def step_counts(opt) -> set:
    """Every parameter's step count as the optimizer's state shows it now (state_dict() would first
    wait for any update still running, and so hide one that an interrupt left behind)."""
    return {int(entry["step"]) for entry in opt.state.values()}


@pytest.mark.parametrize("declared", [None, 2], ids=["at step", "accumulation_steps=2"])
@pytest.mark.parametrize("when", ["on entry", "on the way out"])
@pytest.mark.parametrize("stage", STAGES)
def test_an_interrupt_inside_step_leaves_a_whole_step_or_none(
    link, monkeypatch, stage, when, declared
):
    """After a KeyboardInterrupt inside step(), every parameter is at one step count that
    state_dict() and the next step() agree on, and training on matches AdamW over the steps
    taken (an interrupted step used to finish in the background and drop the next gradients)."""
    if stage == "worker.submit" and declared:
        pytest.skip(
            "with accumulation_steps every bucket is handed over during backward, not in step()"
        )
    mine = mlp()
    opt = CPUOffloadAdam(
        mine.parameters(), lr=1e-2, link=link, accumulation_steps=declared, bucket_bytes=4096
    )
    batches, taken = data(6, 2), []
    for step, micro in enumerate(batches):
        opt.zero_grad()
        backward(mine, micro)
        with monkeypatch.context() as patch:
            fired = interrupt_once(patch, opt._engine, stage, when) if step == 2 else []
            try:
                opt.step()
            except KeyboardInterrupt:
                assert fired, "only the injected interrupt"
        counts = step_counts(opt)
        assert len(counts) == 1, f"parameters at different step counts {sorted(counts)}"
        taken.append(counts.pop() == len(taken) + 1 - taken.count(False))
        if step == 2:
            assert fired
    assert step_counts(opt) == {int(e["step"]) for e in opt.state_dict()["state"].values()}
    assert taken[:2] + taken[3:] == [True] * 5, (
        f"steps taken {taken}: only the interrupted one may be left out"
    )
    opt.close()
    ref = mlp()
    reference = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for micro, was_taken in zip(batches, taken):
        if was_taken:
            reference.zero_grad()
            backward(ref, micro)
            reference.step()
    assert_matches(ref, mine)


def _last_json_line(script) -> dict:
    """Run ``script`` in a Python of its own from the repository root; the JSON it printed last."""
    root = str(Path(__file__).parents[1])
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=root,
        env={**os.environ, "PYTHONPATH": root},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("declared", [None, 2], ids=["at step", "accumulation_steps=2"])
def test_a_real_ctrl_c_during_step_is_held_until_the_step_is_whole(tmp_path, declared):
    """SIGINT, as Ctrl-C or a notebook's interrupt sends it, arriving while step() waits for the
    CPU update: step() finishes the whole step, then raises KeyboardInterrupt."""
    script = tmp_path / "ctrl_c.py"
    script.write_text(
        textwrap.dedent(f"""
        import json, os, signal
        import torch
        from torch import nn
        from offloadlab.offload import CPUOffloadAdam
        from tests.test_offload import data, mlp

        # Ctrl-C raises KeyboardInterrupt, as in a terminal or a notebook, even when this test
        # runs in the background (a shell starts background jobs with SIGINT ignored)
        signal.signal(signal.SIGINT, signal.default_int_handler)

        def backward(model, micro):
            for x, y in micro:
                (nn.functional.mse_loss(model(x), y) / len(micro)).backward()

        mine, ref = mlp(), mlp()
        opt = CPUOffloadAdam(mine.parameters(), lr=1e-2, accumulation_steps={declared},
                             bucket_bytes=4096)
        reference = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        engine = opt._engine
        finish, interrupting = engine._finish, []

        # Ctrl-C as step() starts to wait for the update
        def interrupt_then_finish(*args, **kwargs):
            if interrupting and interrupting.pop():
                os.kill(os.getpid(), signal.SIGINT)
            finish(*args, **kwargs)

        engine._finish = interrupt_then_finish
        interrupts, counts = 0, []
        for step, micro in enumerate(data(6, 2)):
            opt.zero_grad(), reference.zero_grad()
            if step in (1, 3):
                interrupting.append(True)
            backward(mine, micro)
            try:
                opt.step()
            except KeyboardInterrupt:
                interrupts += 1
            backward(ref, micro)
            reference.step()
            counts.append(sorted({{int(e["step"]) for e in opt.state.values()}}))
        opt.close()
        gap = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), mine.parameters()))
        print(json.dumps({{"interrupts": interrupts, "counts": counts, "gap": gap}}))
    """)
    )
    result = _last_json_line(script)
    assert result["interrupts"] == 2
    assert result["counts"] == [[n] for n in range(1, 7)]
    assert result["gap"] < 1e-5


def test_a_real_ctrl_c_during_load_state_dict_is_held_until_the_state_is_whole(tmp_path):
    """Tenth probe pass D50: a Ctrl-C while load_state_dict copied left some parameters' steps
    and moments from the new state dict and the rest from the old one."""
    script = tmp_path / "ctrl_c_load.py"
    script.write_text(
        textwrap.dedent("""
        import json, os, signal
        import torch
        from offloadlab.offload import CPUOffloadAdam
        from tests.test_offload import data, mlp, run

        signal.signal(signal.SIGINT, signal.default_int_handler)
        model = mlp()
        opt = CPUOffloadAdam(model.parameters(), lr=1e-2, bucket_bytes=4096)
        run(model, opt, data(2, 1))
        saved = opt.state_dict()
        run(model, opt, data(3, 1, seed=7))  # the state moves on from the one saved
        host_load, calls = opt._engine.host.load, []

        def interrupted_load(entries):  # Ctrl-C as the copies start
            calls.append(1)
            os.kill(os.getpid(), signal.SIGINT)
            return host_load(entries)

        opt._engine.host.load = interrupted_load
        try:
            opt.load_state_dict(saved)
            interrupted = False
        except KeyboardInterrupt:
            interrupted = True
        now = opt.state_dict()
        whole = all(
            torch.equal(now["state"][k][name], saved["state"][k][name])
            for k in saved["state"] for name in ("step", "exp_avg", "exp_avg_sq")
        )
        opt.close()
        print(json.dumps({"interrupted": interrupted, "calls": len(calls), "whole": whole}))
    """)
    )
    result = _last_json_line(script)
    assert result == {"interrupted": True, "calls": 1, "whole": True}


# ---------------------------------------------------------------------- reload paths


def _train(model, optimizer, batches):
    for micro in batches:
        optimizer.zero_grad()
        backward(model, micro)
        optimizer.step()


@pytest.mark.parametrize("reload", ["a new optimizer", "a new optimizer and its state dict"])
@pytest.mark.parametrize("declared", [None, 2], ids=["at step", "accumulation_steps=2"])
def test_a_reload_between_micro_batches_keeps_the_gradients_collected(link, reload, declared):
    """A new optimizer over the same parameters after the first of two micro-batches: AdamW's
    .grad still holds it, so its step uses both (ours used to drop the first: 1.1 against 0.9)."""
    ref, mine = mlp(), mlp()
    makers = {
        "ref": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
        "mine": lambda m: CPUOffloadAdam(
            m.parameters(), lr=1e-2, link=link, accumulation_steps=declared, bucket_bytes=4096
        ),
    }
    batches = data(4, 2)
    for who, model in (("ref", ref), ("mine", mine)):
        optimizer = makers[who](model)
        _train(model, optimizer, batches[:2])
        optimizer.zero_grad()
        backward(model, batches[2][:1])  # the first micro-batch of step 3 …
        saved = optimizer.state_dict()
        with (
            pytest.warns(UserWarning, match="took their parameters over")
            if who == "mine"
            else _nothing()
        ):
            optimizer = makers[who](model)  # … then the optimizer is made again
        if reload.endswith("state dict"):
            optimizer.load_state_dict(saved)
        backward(model, batches[2][1:])
        optimizer.step()
        _train(model, optimizer, batches[3:])
        if who == "mine":
            optimizer.close()
    if reload.endswith("state dict"):
        assert_matches(ref, mine)
    else:  # a fresh optimizer's first step divides tiny gradients by their own size: ulps grow
        for a, b in zip(ref.parameters(), mine.parameters()):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def twin_layers(order):
    """Two same-shaped layers; the optimizer sees their parameters in ``order``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    params = list(model.parameters())
    return model, (params if order == "same" else params[2:] + params[:2])


def twin_data(steps):
    generator = torch.Generator().manual_seed(3)
    return [
        [(torch.randn(4, 8, generator=generator), torch.randn(4, 8, generator=generator))]
        for _ in range(steps)
    ]


@pytest.mark.parametrize("source", ["CPUOffloadAdam", "torch.optim.AdamW"])
def test_a_state_dict_loaded_into_same_shaped_parameters_in_another_order_leaves_the_weights(
    link, source
):
    """AdamW only mixes up the moments; a saved master that does not round to the parameter's
    value must not replace its weights (ours used to swap the layers: 1.02 off)."""
    make = {
        "CPUOffloadAdam": lambda ps: CPUOffloadAdam(ps, lr=1e-2, link=link),
        "torch.optim.AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    }[source]
    saver, saver_params = twin_layers("same")
    first = make(saver_params)
    _train(saver, first, twin_data(3))
    saved = first.state_dict()
    if source == "CPUOffloadAdam":
        first.close()
    results = []
    for kind in ("ref", "mine"):
        model, params = twin_layers("reversed")
        _train(model, torch.optim.SGD(params, lr=0.1), twin_data(1))  # weights unlike the saver's
        optimizer = (
            torch.optim.AdamW(params, lr=1e-2)
            if kind == "ref"
            else CPUOffloadAdam(params, lr=1e-2, link=link)
        )
        if kind == "mine" and source == "CPUOffloadAdam":
            with pytest.warns(UserWarning, match="do not round to the parameters' current values"):
                optimizer.load_state_dict(copy.deepcopy(saved))
        else:  # (AdamW's loaded state aliases the tensors it was given and moves them on)
            optimizer.load_state_dict(copy.deepcopy(saved))
        _train(model, optimizer, twin_data(3))
        if kind == "mine":
            optimizer.close()
        results.append(model)
    assert_matches(*results)


def test_optimizer_state_loaded_before_the_models_weights_trains_as_adamw(link):
    """The other order of a checkpoint reload: the optimizer's state first, then the model's; the
    masters are passed over (with a warning) and the weights loaded afterwards are trained."""
    saver = mlp()
    first = CPUOffloadAdam(saver.parameters(), lr=1e-2, link=link)
    _train(saver, first, data(3, 1))
    checkpoint = {"model": saver.state_dict(), "optimizer": first.state_dict()}
    first.close()
    ref, mine = mlp(), mlp()
    reference = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    reference.load_state_dict(checkpoint["optimizer"])
    ref.load_state_dict(checkpoint["model"])
    opt = CPUOffloadAdam(mine.parameters(), lr=1e-2, link=link)
    with pytest.warns(UserWarning, match="load the model's state dict first"):
        opt.load_state_dict(checkpoint["optimizer"])
    mine.load_state_dict(checkpoint["model"])
    _train(ref, reference, data(3, 1, seed=5))
    _train(mine, opt, data(3, 1, seed=5))
    opt.close()
    assert_matches(ref, mine)


@pytest.mark.parametrize("edit", list(EDITS), ids=list(EDITS))
def test_weights_changed_while_a_delayed_update_runs_keep_their_values_with_a_warning(link, edit):
    """delayed_update=True: the update pending when the weights are changed by hand would land on
    them one step late; the weights set win, and a warning says that update is dropped for them."""
    model = mlp()
    opt = CPUOffloadAdam(
        model.parameters(), lr=1e-2, link=link, delayed_update=True, bucket_bytes=4096
    )
    batches = data(4, 1)
    for micro in batches[:2]:
        opt.zero_grad()
        backward(model, micro)
        opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    EDITS[edit](model, other_weights())
    edited = [
        (p, p.detach().clone())
        for p, old in zip(model.parameters(), before)
        if p.requires_grad and not torch.equal(p, old)
    ]
    opt.zero_grad()
    backward(model, batches[2])
    with pytest.warns(
        UserWarning,
        match=rf"{len(edited)} parameter\(s\) were changed outside the optimizer "
        rf"while a delayed update was pending",
    ) as caught:
        opt.step()
    assert caught[0].filename == __file__  # the warning names the user's step() line
    assert edited and all(torch.equal(p, value) for p, value in edited)
    opt.close()


@pytest.mark.parametrize("landed", [True, False], ids=["after the new weights", "in a race"])
@pytest.mark.parametrize("edit", list(EDITS), ids=list(EDITS))
def test_weights_changed_between_backward_and_step_with_accumulation_steps_are_named(
    link, edit, landed
):
    """accumulation_steps: the update starts in the last backward pass, so a change made between
    backward and step() comes too late for it (AdamW would update the changed weights). Made
    once the new weights are in, it is kept and named; made at once, it races with them: an
    in-place change is named whichever wins; one through .data only when it lands after them."""
    model = mlp()
    opt = CPUOffloadAdam(
        model.parameters(), lr=1e-2, link=link, accumulation_steps=1, bucket_bytes=4096
    )
    batches = data(3, 1)
    for micro in batches[:2]:  # a normal step says nothing
        opt.zero_grad()
        backward(model, micro)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt.step()
    opt.zero_grad()
    backward(model, batches[2])
    if landed:
        for bucket in opt.buckets:
            bucket.updated.wait()
            bucket.upload.synchronize()
    before = [p.detach().clone() for p in model.parameters()]
    EDITS[edit](model, other_weights())
    changed = any(not torch.equal(p, old) for p, old in zip(model.parameters(), before))
    # (vector_to_parameters assigns .data; load_state_dict copies in place under no_grad)
    through_data = edit not in ("no_grad in-place clamp_", "model.load_state_dict")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    named = [w for w in caught if "changed by hand between backward and step()" in str(w.message)]
    if changed and (landed or not through_data):
        assert len(named) == 1, [str(w.message) for w in caught]
        assert named[0].filename == __file__
    if landed and changed:
        edited = [p for p, old in zip(model.parameters(), before) if not torch.equal(p, old)]
        assert "kept without this step's update" in str(named[0].message) and edited
    opt.close()


# ---------------------------------------------------------------------- refusals in words


def test_a_step_without_zero_grad_says_it_consumed_the_last_steps_gradients(link):
    """AdamW adds the last step's gradients to this one's when zero_grad() is skipped; step() here
    consumes them (0.0687 off AdamW), and the first step that would differ says so, once."""
    model = mlp()
    opt = CPUOffloadAdam(model.parameters(), lr=1e-2, link=link)
    batches = data(3, 1)
    backward(model, batches[0])
    opt.step()  # the first step: nothing came before it
    for micro in batches[1:]:
        backward(model, micro)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        said = [
            w for w in caught if "step() without zero_grad() since the last step" in str(w.message)
        ]
        assert len(said) == (micro is batches[1]), [str(w.message) for w in caught]
        assert all(w.filename == __file__ for w in said)  # the user's step() line
    opt.zero_grad()
    backward(model, batches[0])
    opt.step()
    opt.close()


@pytest.mark.parametrize(
    "how", ["a view of another parameter", "the same tensor twice", "added later"]
)
def test_parameters_that_share_memory_are_refused_at_construction(link, how):
    """nn.Parameter(b) beside nn.Parameter(b[:4]) used to train and diverge from AdamW (0.51)."""
    base = torch.randn(8)
    first = nn.Parameter(base)
    second = nn.Parameter(base[:4] if how != "the same tensor twice" else base)
    with pytest.raises(ValueError, match="two trainable parameters share memory"):
        if how == "added later":
            opt = CPUOffloadAdam([first], link=link)
            try:
                opt.add_param_group({"params": [second]})
            finally:
                opt.close()
        else:
            CPUOffloadAdam([first, second], link=link)
    neighbours = base.view(2, 4)  # side by side in one tensor, not overlapping: accepted
    CPUOffloadAdam([nn.Parameter(neighbours[0]), nn.Parameter(neighbours[1])], link=link).close()


def test_a_parameter_on_the_meta_device_is_refused_in_words(link):
    with torch.device("meta"):
        layer = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="on the meta device .* materialise the model first"):
        CPUOffloadAdam(layer.parameters(), link=link)


@pytest.mark.parametrize(
    "convert", [lambda m: m.to(torch.bfloat16), lambda m: m.double()], ids=["bf16", "double"]
)
def test_a_model_converted_after_the_optimizer_was_made_is_named_and_the_optimizer_stays_open(
    link, convert
):
    """It used to fail at step() with 'targets: expected device tensors shaped like their views
    of staging…' and close the optimizer."""
    model = mlp()
    opt = CPUOffloadAdam(model.parameters(), lr=1e-2, link=link)
    convert(model)
    x, y = data(1, 1)[0][0]
    with pytest.raises(
        RuntimeError,
        match=r"a parameter is now torch\.\w+ on cpu, but was torch\.float32 .* "
        r"convert the model first, then make the optimizer",
    ):
        nn.functional.mse_loss(
            model(x.to(model[0].weight.dtype)), y.to(model[0].weight.dtype)
        ).backward()
    with pytest.raises(RuntimeError, match="convert the model first"):
        opt.step()
    assert not opt.closed
    opt.close()


@pytest.mark.parametrize("then", ["zero_grad", "step"])
def test_after_one_backward_too_many_the_first_ones_step_stands_and_training_goes_on(link, then):
    """accumulation_steps=1 and a second backward: refused, and that pass dropped. zero_grad()
    used to leave every later backward raising, and step() used to apply the extra pass."""
    ref, mine = mlp(), mlp()
    reference = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = CPUOffloadAdam(mine.parameters(), lr=1e-2, link=link, accumulation_steps=1)
    batches = data(4, 1)
    backward(mine, batches[0])
    with pytest.raises(
        RuntimeError, match="more backward passes than accumulation_steps=1 .* dropped"
    ):
        backward(mine, batches[1])
    getattr(opt, then)()
    reference.zero_grad()
    backward(ref, batches[0])
    reference.step()
    for micro in batches[2:]:
        for model, optimizer in ((ref, reference), (mine, opt)):
            optimizer.zero_grad()
            backward(model, micro)
            optimizer.step()
    opt.close()
    assert_matches(ref, mine)


def test_adamws_own_flags_at_their_defaults_are_taken_and_others_refused_by_name():
    """The finding (issue 37, 12): AdamW's flags at their defaults raised TypeError in the
    constructor, though the class takes AdamW's arguments (and accepts them in a param group)."""
    model = nn.Linear(4, 4)
    opt = CPUOffloadAdam(
        model.parameters(),
        1e-3,
        (0.9, 0.999),
        1e-8,
        1e-2,
        False,
        maximize=False,
        foreach=None,
        capturable=False,
        differentiable=False,
        fused=None,
    )
    opt.close()
    for flag, value, message in (
        ("amsgrad", True, "amsgrad: CPUOffloadAdam does not implement it; got True"),
        ("maximize", True, "maximize: CPUOffloadAdam does not implement it; got True"),
        ("capturable", True, "capturable: CPUOffloadAdam does not implement it; got True"),
        ("differentiable", True, "differentiable: CPUOffloadAdam does not implement"),
        ("foreach", "yes", "foreach: expected True, False or None; got 'yes'"),
        ("fused", 1, "fused: expected True, False or None; got 1"),
    ):
        with pytest.raises(ValueError, match=f"^{message}"):
            CPUOffloadAdam(model.parameters(), **{flag: value})


def test_a_link_that_is_not_a_link_is_refused_by_name():
    """The finding (issue 37, 9): link="emulated" raised AttributeError: 'str' object has no
    attribute 'device'."""
    with pytest.raises(
        ValueError, match="^link: expected an offloadlab.link.Link .* got 'emulated'"
    ):
        CPUOffloadAdam(nn.Linear(4, 4).parameters(), link="emulated")


def test_a_state_dict_without_state_is_refused_not_taken_as_fresh(link):
    """The finding (issue 37, 1): a dict without "state" reset every moment and step count to
    zero; torch.optim.AdamW raises (KeyError). It is refused, and nothing changes."""
    model = nn.Linear(4, 4)
    opt = CPUOffloadAdam(model.parameters(), link=link)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    saved = opt.state_dict()
    with pytest.raises(ValueError, match="^state_dict: expected a dict with 'param_groups'"):
        opt.load_state_dict({"param_groups": saved["param_groups"]})
    assert all(int(s["step"]) == 1 for s in opt.state_dict()["state"].values())
    opt.close()


def test_a_second_step_without_backward_or_zero_grad_says_what_adamw_would_do(link):
    """The finding (issue 37, 2): step() twice after one backward; AdamW applies the same .grad a
    second time, this optimizer (its gradients consumed) did nothing, in silence."""
    model = nn.Linear(4, 4)
    opt = CPUOffloadAdam(model.parameters(), link=link)
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    weights = model.weight.detach().clone()
    with pytest.warns(UserWarning, match="would apply the last step's gradients a second time"):
        opt.step()
    assert torch.equal(model.weight.detach(), weights)
    opt.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # (zero_grad() said there are none: AdamW does nothing either)
    opt.close()
