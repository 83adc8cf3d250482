"""torch.optim's state-dict format for the DistributedOptimizers, whose state is sliced across ranks: gathered in
full (so it loads on any number of ranks, and into torch.optim), loaded back into this rank's slices. A mixin of
DistributedOptimizer (optim/base.py): it reads the groups' updates (`_updates`), per-parameter step counts
(`_presence`) and the class's `state_names` / `torch_group_keys`."""

from __future__ import annotations

from typing import Any

import torch


class TorchStateDict:
    """state_dict / load_state_dict of a DistributedOptimizer."""

    _IMPLEMENTATION_KEYS: tuple[str, ...]

    def _gather(self, u: Any, local: torch.Tensor) -> torch.Tensor:
        if u.compiled is None or self.group_size == 1:
            return local.clone()
        if u.arena is not None:  # every slice is readable here: no collective
            return torch.cat([u.arena.peer_view(local, peer) for peer in range(self.group_size)])
        return u.compiled.comm.all_gather(local.contiguous(), 0)

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's format, with the FULL state of each parameter, gathered from the slices: on one node read
        from shared memory, so one rank may call it alone (nanoGPT's `if master_process: save`); across nodes a
        collective, which every rank must call. Every caller gets the same dict. Parameters are numbered across the
        groups in order, as torch.optim does; groups carry torch.optim's keys (`torch_group_keys`). The state-dict
        hooks registered as with torch.optim run before and after."""
        for pre in self._optimizer_state_dict_pre_hooks.values():
            pre(self)
        out = self._state_dict()
        for post in self._optimizer_state_dict_post_hooks.values():
            returned = post(self, out)
            out = out if returned is None else returned
        return out

    def _state_dict(self) -> dict[str, Any]:
        keys = {**self.state_names, "master": "master"}
        state, groups, first = {}, [], 0
        for g, u, steps in zip(self.param_groups, self._updates, self._presence.steps):
            full = {name: self._gather(u, t)[:u.flat.numel] for name, t in u.local_state.items()}
            k = len(g["params"])
            for i, pos in enumerate(u.trainable):
                if not steps[i]:  # frozen parameters and those never stepped have no state, as in torch.optim
                    continue
                entry: dict[str, Any] = {"step": torch.tensor(float(steps[i]))}
                for name, t in full.items():
                    entry[keys[name]] = u.flat.view(t, i).clone()
                state[first + pos] = entry
            groups.append({**self.torch_group_keys, **{key: v for key, v in g.items() if key != "params"},
                           "params": list(range(first, first + k))})
            first += k
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by `state_dict` (on any number of ranks), or by the matching torch.optim class:
        hyperparameters, step and this rank's slices of the state. Missing state (saved before the first step) loads
        as zeros. A saved setting this optimizer does not implement (amsgrad, maximize, ...) is refused, naming it.
        Each parameter's step count comes from its entry (none: 0, as a parameter torch.optim never stepped). The
        load-state-dict hooks registered as with torch.optim run before and after."""
        for pre in self._optimizer_load_state_dict_pre_hooks.values():
            returned = pre(self, state_dict)
            state_dict = state_dict if returned is None else returned
        self._load_state_dict(state_dict)
        for post in self._optimizer_load_state_dict_post_hooks.values():
            post(self)

    def _check_torch_keys(self, gi: int, saved: dict[str, Any]) -> None:
        name = type(self).__name__
        group = self.param_groups[gi]
        mine = {**self.torch_group_keys, **{k: group[k] for k in ("decoupled_weight_decay",) if k in group}}
        for key, ours in mine.items():
            if key in self._IMPLEMENTATION_KEYS or key not in saved or saved[key] == ours:
                continue
            if key == "decoupled_weight_decay" and not saved.get("weight_decay"):
                continue  # without weight decay both forms are the same update
            raise ValueError(f"{name}.load_state_dict: saved group {gi} has {key}={saved[key]!r}; {name} "
                             f"implements {key}={ours!r} only, so loading it would silently change the update")

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        name = type(self).__name__
        groups, state = state_dict.get("param_groups"), state_dict.get("state")
        if not isinstance(groups, list) or len(groups) != len(self.param_groups) or not isinstance(state, dict):
            raise ValueError(f"{name}.load_state_dict: expected {{'state': ..., 'param_groups': "
                             f"[{len(self.param_groups)} group(s)]}}, got param_groups={groups!r:.80}")
        # without weight decay both forms of it are the same update: keep this optimizer's (its compiled program)
        groups = [{**saved, "decoupled_weight_decay": mine["decoupled_weight_decay"]}
                  if "decoupled_weight_decay" in mine and "decoupled_weight_decay" in saved
                  and not saved.get("weight_decay") else saved for saved, mine in zip(groups, self.param_groups)]
        keys = {**self.state_names, "master": "master"}
        entry = lambda i: state.get(i, state.get(str(i), {}))  # noqa: E731 - JSON-like dicts have str keys
        for gi, (saved, u) in enumerate(zip(groups, self._updates)):
            ids = saved.get("params", [])
            if len(ids) != len(self.param_groups[gi]["params"]):
                raise ValueError(f"{name}.load_state_dict: saved group {gi} has {len(ids)} parameters, this "
                                 f"optimizer's {len(self.param_groups[gi]['params'])}")
            for i, pid in enumerate(ids[pos] for pos in u.trainable):
                for sname in u.local_state:
                    t = entry(pid).get(keys[sname])
                    if t is not None and tuple(t.shape) != tuple(u.flat.shapes[i]):
                        raise ValueError(f"{name}.load_state_dict: state {keys[sname]!r} of parameter {pid} has "
                                         f"shape {tuple(t.shape)}, the parameter {tuple(u.flat.shapes[i])}")
            self._check_torch_keys(gi, saved)
            structure = self._structure_of({**self.param_groups[gi], **saved})
            if structure != u.structure:
                raise ValueError(f"{name}.load_state_dict: saved hyperparameters {structure} of group {gi} select "
                                 f"another program than this optimizer's {u.structure}")
        for saved, u in zip(groups, self._updates):
            for sname, local in u.local_state.items():
                parts = []
                for i, pid in enumerate(saved["params"][pos] for pos in u.trainable):
                    t = entry(pid).get(keys[sname])
                    if t is None:
                        t = (u.flat.view(u.flat.flat, i) if sname == "master"
                             else torch.zeros(u.flat.shapes[i], dtype=local.dtype))
                    parts.append(t.reshape(-1).to(local.dtype))
                local.copy_(u.flat.pad(torch.cat(parts))[u.slice])
        for saved, u, steps in zip(groups, self._updates, self._presence.steps):
            for i, pid in enumerate(saved["params"][pos] for pos in u.trainable):
                steps[i] = int(float(entry(pid).get("step", 0)))
        self.steps = max((int(s.max()) for s in self._presence.steps), default=0)
        for g, saved in zip(self.param_groups, groups):
            g.update({key: v for key, v in saved.items() if key != "params"})
