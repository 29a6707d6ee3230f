"""The lowering's nesting: one Scope per open loop or branch, with the values computed in it."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..ir import UOp
from .linear import If, Instr, Item, Loop


@dataclass(eq=False)
class Scope:
    items: list[Item]
    range: UOp | None
    owner: Loop | If | None = None      # the item of the parent's list that holds `items`
    memo: dict[UOp, Instr] = field(default_factory=dict)
    open_children: list[Item] = field(default_factory=list)  # hoisted code goes before the open one

    def insert(self, item: Item) -> None:
        if self.open_children:
            child = self.open_children[-1]
            idx = self.items.index(child)   # items compare by identity (dataclasses with eq=False)
            self.items.insert(idx, item)
        else:
            self.items.append(item)

