"""`unfuse`/`fuse` carry training state (gradients, optimizer state) or refuse, and roll back to the very same objects."""

import copy
import unittest
from unittest import mock

import torch

import surgery
from surgery.core.walk import find_modules
import surgery.core.rewrite
from surgery.testing import single_rank_group
from flux2_testing import assert_unchanged, build, inputs, rel_err, small_config, snapshot

CONFIG = small_config("klein4b_small")
SINGLE = "single_transformer_blocks.1.attn"


def loss(model, seed):
    return model(**inputs(CONFIG, seed), return_dict=False)[0].square().mean()


def step(model, optimizer, seed):
    optimizer.zero_grad()
    loss(model, seed).backward()
    optimizer.step()


def in_fused_layout(model, tensors: dict) -> dict[str, torch.Tensor]:
    return surgery.state_dict.fuse_state_dict(tensors, surgery.state_dict.weight_slices(model)) if find_modules(model, False) else tensors


def fused_view(model) -> dict[str, torch.Tensor]:
    """The model's parameters in the fused layout, whichever form it is in."""
    return in_fused_layout(model, {n: p.detach() for n, p in model.named_parameters()})


def fused_grads(model) -> dict[str, torch.Tensor]:
    return in_fused_layout(model, {n: p.grad for n, p in model.named_parameters()})


def worst(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(rel_err(a[k], b[k]) for k in a)


def grad_snapshot(model) -> dict:
    return {n: (id(p.grad), p.grad.clone()) for n, p in model.named_parameters() if p.grad is not None}


def optimizer_snapshot(optimizer) -> tuple:
    groups = [[id(p) for p in g["params"]] for g in optimizer.param_groups]
    state = {id(p): {k: (id(v), v.clone()) for k, v in s.items()} for p, s in optimizer.state.items()}
    return groups, state


class CarriedOver(unittest.TestCase):
    def test_adamw_step_after_unfuse_equals_the_fused_models(self):
        """The brief's check: 2 fused steps vs 1 fused + unfuse + 1 unfused (the second backward runs unfused)."""
        reference = build(CONFIG)
        model = copy.deepcopy(reference)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        for seed in (1, 2):
            step(reference, ref_opt, seed)
        step(model, optimizer, 1)
        surgery.unfuse(model, optimizer=optimizer)
        self.assertEqual(len(optimizer.param_groups[0]["params"]), len(list(model.parameters())))
        self.assertEqual({id(p) for p in optimizer.state}, {id(p) for p in model.parameters()})
        step(model, optimizer, 2)
        error = worst(fused_view(model), fused_view(reference))
        print(f"AdamW, 2 fused steps vs 1 fused + unfuse + 1 unfused: worst parameter rel err {error:.2e}")
        self.assertLessEqual(error, 1e-6)

    def test_same_gradients_give_bitwise_the_same_adamw_step_both_ways(self):
        """With the gradients of one fused backward carried over, the step after unfuse (and after fuse) is bitwise
        the fused model's: the remap itself loses nothing."""
        reference = build(CONFIG)
        model = copy.deepcopy(reference)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        for m, opt in ((reference, ref_opt), (model, optimizer)):
            step(m, opt, 1)
            loss(m, 2).backward()
        surgery.unfuse(model, optimizer=optimizer)
        for opt in (ref_opt, optimizer):
            opt.step()
        self.assertEqual(worst(fused_view(model), fused_view(reference)), 0.0)
        ref_opt.zero_grad()
        loss(reference, 3).backward()
        surgery.fuse(model, optimizer=optimizer)
        for p, q in zip(model.parameters(), reference.parameters()):
            p.grad = q.grad.clone()  # the same gradients for both, from the fused reference
        for opt in (ref_opt, optimizer):
            opt.step()
        self.assertEqual(worst(fused_view(model), fused_view(reference)), 0.0)
        for p, q in zip(model.parameters(), reference.parameters()):
            for key in ("exp_avg", "exp_avg_sq", "step"):
                self.assertTrue(torch.equal(optimizer.state[p][key], ref_opt.state[q][key]), key)

    def test_unfused_state_is_the_fused_state_sliced(self):
        model = build(CONFIG)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step(model, optimizer, 1)
        fused = model.single_transformer_blocks[1].attn.to_qkv_mlp_proj.weight
        exp_avg, grad = optimizer.state[fused]["exp_avg"], fused.grad
        out = model.single_transformer_blocks[1].attn.to_out.weight
        out_sq, out_grad = optimizer.state[out]["exp_avg_sq"].clone(), out.grad.clone()
        surgery.unfuse(model, optimizer=optimizer)
        attn = model.single_transformer_blocks[1].attn
        inner = attn.inner_dim
        to_k = optimizer.state[attn.to_qkv_mlp_proj.k.weight]
        self.assertTrue(torch.equal(to_k["exp_avg"], exp_avg[inner:2 * inner]))
        self.assertEqual(to_k["exp_avg"].data_ptr(), exp_avg[inner:2 * inner].data_ptr())  # rows: views
        self.assertEqual(attn.to_qkv_mlp_proj.k.weight.grad.data_ptr(), grad[inner:2 * inner].data_ptr())
        mlp_out = attn.to_out.mlp_part.weight  # columns: copies
        self.assertTrue(torch.equal(mlp_out.grad, out_grad[:, inner:]))
        self.assertTrue(torch.equal(optimizer.state[mlp_out]["exp_avg_sq"], out_sq[:, inner:]))
        self.assertTrue(torch.equal(optimizer.state[attn.to_out.attn_part.weight]["exp_avg_sq"], out_sq[:, :inner]))

    def test_named_parameter_groups_are_renamed(self):
        model = build(CONFIG)
        optimizer = torch.optim.SGD(model.named_parameters(), lr=0.1)
        surgery.unfuse(model, optimizer=optimizer)
        group = optimizer.param_groups[0]
        self.assertEqual(sorted(group["param_names"]), sorted(n for n, _ in model.named_parameters()))
        for name, param in zip(group["param_names"], group["params"]):
            self.assertIs(model.get_parameter(name), param)

    def test_gradients_accumulated_before_unfuse_are_kept(self):
        reference = build(CONFIG)
        model = copy.deepcopy(reference)
        for seed in (1, 2):
            loss(reference, seed).backward()
        loss(model, 1).backward()
        surgery.unfuse(model)
        loss(model, 2).backward()
        self.assertLessEqual(worst(fused_grads(model), fused_grads(reference)), 1e-6)
        surgery.fuse(model)
        self.assertLessEqual(worst(fused_grads(model), fused_grads(reference)), 1e-6)


class Refused(unittest.TestCase):
    def setUp(self):
        self.model = build(CONFIG)

    def assert_refused(self, pattern, verb=surgery.unfuse, model=None, **kw):
        model = model or self.model
        snap = snapshot(model)
        with self.assertRaisesRegex(surgery.SurgeryError, pattern):
            verb(model, **kw)
        assert_unchanged(model, snap)

    def test_optimizer_not_passed(self):
        optimizer = torch.optim.AdamW(self.model.parameters())
        self.assert_refused(r"an optimizer \(AdamW\) that was not passed holds 'transformer_blocks.0.ff.linear_in."
                            r"weight'.*optimizer=opt")
        other = torch.optim.SGD(self.model.parameters(), lr=0.1)  # two optimizers: both must be passed
        self.assert_refused(r"\(SGD\) that was not passed", optimizer=optimizer)
        surgery.unfuse(self.model, optimizer=[optimizer, other])
        optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.assert_refused(r"\(SGD\) that was not passed holds 'transformer_blocks.0.ff.linear_in.gate.weight'", surgery.fuse)

    def test_tensor_hooks(self):
        handle = self.model.single_transformer_blocks[1].attn.to_qkv_mlp_proj.weight.register_hook(lambda g: g)
        self.assert_refused(rf"'{SINGLE}.to_qkv_mlp_proj.weight' has tensor hooks \(register_hook\)")
        handle.remove()
        weight = self.model.transformer_blocks[0].ff_context.linear_in.weight
        weight.register_post_accumulate_grad_hook(lambda p: None)
        self.assert_refused(r"'transformer_blocks.0.ff_context.linear_in.weight' has post-accumulate-grad hooks")

    def test_state_dict_hooks_on_swapped_modules(self):
        self.model.single_transformer_blocks[2].attn.register_load_state_dict_post_hook(lambda *a: None)
        self.assert_refused(r"'single_transformer_blocks.2.attn' .* has _load_state_dict_post_hooks")
        self.model = build(CONFIG)
        self.model.transformer_blocks[0].ff.linear_in._register_state_dict_hook(lambda *a: None)
        self.assert_refused(r"'transformer_blocks.0.ff.linear_in' .* has _state_dict_hooks")

    def test_tied_weights(self):
        blocks = self.model.single_transformer_blocks
        blocks[1].attn.to_out.weight = blocks[0].attn.to_out.weight
        self.assert_refused(r"'single_transformer_blocks.0.attn.to_out.weight' is tied to "
                            r"'single_transformer_blocks.1.attn.to_out.weight'")

    def test_inference_tensors(self):
        with torch.inference_mode():
            model = build(CONFIG)
        self.assert_refused(r"'transformer_blocks.0.ff.linear_in.weight' is an inference tensor.*outside "
                            r"inference_mode", model=model)

    def test_fuse_parts_with_and_without_grad(self):
        surgery.unfuse(self.model)
        self.model.transformer_blocks[0].ff.linear_in.gate.weight.grad = torch.ones(144, 48)
        self.assert_refused(r"'transformer_blocks.0.ff.linear_in.gate.weight' has a .grad and "
                            r"'transformer_blocks.0.ff.linear_in.up.weight' has none", surgery.fuse)


class Wrapped(unittest.TestCase):
    """DDP and FSDP need a process group: a world-1 gloo group in this process."""

    @classmethod
    def setUpClass(cls):
        from torch.distributed.device_mesh import init_device_mesh

        cls.group = single_rank_group()
        cls.group.__enter__()
        cls.mesh = init_device_mesh("cpu", (1,))

    @classmethod
    def tearDownClass(cls):
        cls.group.__exit__(None, None, None)

    def assert_refused(self, pattern, target, model):
        snap = snapshot(model)
        with self.assertRaisesRegex(surgery.SurgeryError, pattern):
            surgery.unfuse(target)
        assert_unchanged(model, snap)

    def test_ddp(self):
        from torch.nn.parallel import DistributedDataParallel

        model = build(CONFIG)
        ddp = DistributedDataParallel(model)
        order = r"Call surgery.unfuse on the unwrapped model first, then wrap: `surgery.unfuse\(model\); model = Dist"
        self.assert_refused(rf"'DistributedDataParallel' is wrapped by DistributedDataParallel.*{order}", ddp, model)
        self.assert_refused(rf"is wrapped by DistributedDataParallel.*{order}", model, model)  # the inner module too

    def test_fsdp2_unsharded(self):
        from torch.distributed.fsdp import fully_shard

        model = build(CONFIG)
        fully_shard(model, mesh=self.mesh, reshard_after_forward=False)
        with torch.no_grad():
            model(**inputs(CONFIG, 0))  # unsharded state: plain tensors registered again
        self.assert_refused(r"'FSDPFlux2Transformer2DModel' is wrapped by FSDP2 \(fully_shard\).*then wrap", model, model)

    def test_fsdp1(self):
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = build(CONFIG)
        wrapped = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)
        self.assert_refused(r"is wrapped by FullyShardedDataParallel \(FSDP1\)", wrapped, wrapped)


class Rollback(unittest.TestCase):
    def trained(self):
        model = build(CONFIG)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step(model, optimizer, 1)
        loss(model, 2).backward()
        return model, optimizer

    def assert_rolled_back(self, verb, patch, fail_at, error):
        model, optimizer = self.trained()
        if verb is surgery.fuse:
            surgery.unfuse(model, optimizer=optimizer)
        snap, grads, opt_snap = snapshot(model), grad_snapshot(model), optimizer_snapshot(optimizer)
        original, calls = getattr(surgery.core.rewrite, patch), []
        to_out = model.single_transformer_blocks[0].attn.to_out  # column-split: released once swapped
        to_out = getattr(to_out, "attn_part", to_out).weight
        released = []

        def failing(*args):
            calls.append(1)
            if len(calls) == fail_at:
                released.append(to_out.numel() == 0 and to_out.grad.numel() == 0)
                raise error
            return original(*args)

        with mock.patch.object(surgery.core.rewrite, patch, failing), self.assertRaises(type(error)):
            verb(model, optimizer=optimizer)
        self.assertEqual(released, [True])  # the failure came after single block 0 released its column copies
        assert_unchanged(model, snap)  # the same module and Parameter objects, with their values
        self.assertEqual(grad_snapshot(model).keys(), grads.keys())
        for name, (gid, value) in grads.items():
            self.assertEqual(id(model.get_parameter(name).grad), gid, name)
            self.assertTrue(torch.equal(model.get_parameter(name).grad, value), name)
        groups, state = optimizer_snapshot(optimizer)
        self.assertEqual(groups, opt_snap[0])
        self.assertEqual(state.keys(), opt_snap[1].keys())
        for pid, entries in opt_snap[1].items():
            for key, (vid, value) in entries.items():
                self.assertEqual(state[pid][key][0], vid)
                self.assertTrue(torch.equal(state[pid][key][1], value))
        step(model, optimizer, 3)  # and it still trains

    def test_keyboard_interrupt_after_column_copies_were_released(self):
        # swaps: ff, ff_context, then the single blocks: blocks 0 and 1 have released their old to_out columns (weight,
        # grad, Adam state) when the release after the 5th swap is interrupted
        self.assert_rolled_back(surgery.unfuse, "_release", 5, KeyboardInterrupt())

    def test_memory_error_while_converting(self):
        self.assert_rolled_back(surgery.unfuse, "_convert", 4, MemoryError("simulated"))

    def test_fuse_interrupted(self):
        self.assert_rolled_back(surgery.fuse, "_release", 5, KeyboardInterrupt())

    def test_old_weights_held_elsewhere_keep_their_values(self):
        model = build(CONFIG)
        old = model.single_transformer_blocks[0].attn.to_out.weight
        value = old.detach().clone()
        surgery.unfuse(model)
        self.assertTrue(torch.equal(old.detach(), value))


class Cost(unittest.TestCase):
    def test_no_garbage_collector_scan_when_nothing_else_holds_the_parameters(self):
        model = build(CONFIG)
        with mock.patch.object(surgery.core.rewrite.gc, "get_objects", wraps=surgery.core.rewrite.gc.get_objects) as scan:
            surgery.fuse(surgery.unfuse(model))
            self.assertEqual(scan.call_count, 0)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # noqa: F841 - holds them now
            with self.assertRaises(surgery.SurgeryError):
                surgery.unfuse(model)
            self.assertEqual(scan.call_count, 1)
