"""Path locks and their receipts: every walk that changes ``lock_ref`` / ``host_lock_ref``.

Pure Python, owner thread only. A device lock on a node increments ``lock_ref`` on it and on
every ancestor up to the root (a locked node is never evicted from the device); a host lock
does the same with ``host_lock_ref`` (a host-locked node keeps its host copy). Taking a lock
returns a ``LockReceipt`` naming exactly what was incremented: the node the device walk
started from (or None) and the node the host walk started from (or None). ``release``
decrements exactly that, once; releasing a receipt twice raises ValueError and changes
nothing, so a lock can never be released without having been taken. A node the receipt
names that a split moved down keeps its place: the walk is redone from the same node at
release, and a split copies the counts to the new upper part, so the counts always balance.
After ``reset`` (every node deleted) releasing an old receipt is a no-op.

0 <-> 1 transitions move the node's tokens between ``Residency.evictable_tokens`` and
``protected_tokens`` and decide its eviction-index membership; the walks below inline that
(these are the hottest loops of a request after the tree walk itself).
"""

from __future__ import annotations

from .residency import Residency
from .tree_node import TreeNode


class LockReceipt:
    """What one lock incremented: a device path from ``device`` and/or a host path from ``host``."""

    __slots__ = ("device", "host", "live")

    def __init__(self, device: TreeNode | None, host: TreeNode | None) -> None:
        self.device = device
        self.host = host
        self.live = True

    @property
    def node(self) -> TreeNode:
        """The deepest node the lock protects."""
        return self.host if self.host is not None else self.device

    def __repr__(self) -> str:
        state = "live" if self.live else "released"
        return f"LockReceipt(device={self.device!r}, host={self.host!r}, {state})"


class PathLocks:
    """Every path-lock walk of one tree; see the module docstring."""

    def __init__(self, residency: Residency) -> None:
        self.res = residency
        self.hooked: tuple = ()  # components with their own residency (``components``)

    # ------------------------------------------------------------------ taking
    def lock(self, node: TreeNode) -> LockReceipt:
        """Device path lock from ``node`` (on the device) up to the root."""
        self._lock_path(node)
        receipt = LockReceipt(node, None)
        if self.hooked:
            self._hook_lock(receipt)
        return receipt

    def lock_host(self, node: TreeNode) -> LockReceipt:
        """Host path lock from ``node`` (backed up) up to the root."""
        self._host_lock_path(node)
        receipt = LockReceipt(None, node)
        if self.hooked:
            self._hook_lock(receipt)
        return receipt

    def lock_both(self, node: TreeNode, dev_from: TreeNode | None = None) -> LockReceipt:
        """A host lock from ``node`` and a device lock from ``dev_from`` (``node`` or one of its
        ancestors; default ``node``) in one walk: a transfer's two locks."""
        if dev_from is None:  # TreeNode has __len__: never test it for truth
            dev_from = node
        self._lock_both_paths(node, dev_from)
        receipt = LockReceipt(dev_from, node)
        if self.hooked:
            self._hook_lock(receipt)
        return receipt

    def move(self, receipt: LockReceipt, new: TreeNode) -> LockReceipt:
        """Trade a live device-only receipt for a device lock on ``new``: ``lock(new)`` then
        ``release(receipt)``, walking only the nodes below the old one when ``new`` is its
        descendant (a request growing down its path)."""
        self._check(receipt)
        if receipt.host is not None:
            raise ValueError("receipt: only a device lock moves")
        old = receipt.device
        receipt.live = False
        if self.hooked:
            self._hook_release(receipt)
        if old.deleted:
            self._lock_path(new)
        else:
            self._move_path(old, new)
        moved = LockReceipt(new, None)
        if self.hooked:
            self._hook_lock(moved)
        return moved

    def extend_to_loaded_chain(self, receipt: LockReceipt, chain: list) -> LockReceipt:
        """A load-back's receipt: ``receipt`` (host lock from the chain's last node, device lock
        from the chain's on-device anchor) becomes a device and host lock from the last node,
        now that the chain (evicted, so device-unlocked until now) holds device pages. Each
        chain node's count goes 0 -> 1; the caller counted the chain's tokens as protected."""
        self._check(receipt)
        if receipt.host is not chain[-1] or receipt.device is not chain[0].parent:
            raise ValueError("receipt: not a load-back's lock on this chain")
        receipt.live = False
        if self.hooked:
            self._hook_release(receipt)
        for c in chain:
            c.lock_ref = 1
        extended = LockReceipt(chain[-1], chain[-1])
        if self.hooked:
            self._hook_lock(extended)
        return extended

    # ------------------------------------------------------------------ releasing
    def release(self, receipt: LockReceipt) -> None:
        """Decrement exactly what ``receipt`` incremented, once."""
        self._check(receipt)
        receipt.live = False
        if self.hooked:
            self._hook_release(receipt)
        dev, host = receipt.device, receipt.host
        if dev is not None and host is dev:
            if not dev.deleted:
                self._unlock_both_paths(dev)
            return
        if dev is not None and not dev.deleted:
            self._unlock_path(dev)
        if host is not None and not host.deleted:
            self._host_unlock_path(host)

    def _hook_lock(self, receipt: LockReceipt) -> None:
        for comp in self.hooked:
            comp.on_lock(receipt)

    def _hook_release(self, receipt: LockReceipt) -> None:
        for comp in self.hooked:
            comp.on_release(receipt)

    @staticmethod
    def _check(receipt: LockReceipt) -> None:
        # Receipts reach here from the cache's own modules; the facade type-checks callers'.
        if not receipt.live:
            raise ValueError(f"receipt: {receipt!r} was already released")

    # ------------------------------------------------------------------ a single node's host copy
    def guard_host_copy(self, node: TreeNode) -> None:
        """Keep ``node``'s host copy (no path walk: its ancestors' copies are safe by
        contiguity) while host eviction runs; ``unguard_host_copy`` undoes it."""
        node.host_lock_ref += 1
        if node in self.res.reclaim_members:
            self.res.reclaim_index.set_member(node, False)

    def unguard_host_copy(self, node: TreeNode) -> None:
        """Undo ``guard_host_copy``; the caller refreshes the node's index membership (it is
        about to change the node's residency anyway)."""
        node.host_lock_ref -= 1

    # ------------------------------------------------------------------ the walks
    def _lock_path(self, node: TreeNode) -> None:
        res = self.res
        root = res.root
        dm = res.dev_members
        moved = 0
        while node is not root:
            if node.lock_ref == 0:
                moved += node.size
                node.lock_ref = 1
                if node in dm:  # inlined device_index.set_member(node, False)
                    dm.discard(node)
                    node.heap_stamp[0] = 0
            else:
                node.lock_ref += 1
            node = node.parent
        if moved:
            res.evictable_tokens -= moved
            res.protected_tokens += moved

    def _unlock_path(self, node: TreeNode) -> None:
        res = self.res
        root = res.root
        dl = res.device_index
        moved = 0
        while node is not root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                moved += node.size
                # Inlined refresh: the device lock only decides device-index membership, and
                # a locked node is on the device: it joins the index iff it is a device leaf.
                if node.dev_children == 0:
                    dl.set_member(node, True)
            node = node.parent
        if moved:
            res.evictable_tokens += moved
            res.protected_tokens -= moved

    def _move_path(self, old: TreeNode, new: TreeNode) -> None:
        res = self.res
        root = res.root
        path = []
        n = new
        while n is not old:
            if n is root:
                self._lock_path(new)
                self._unlock_path(old)
                return
            path.append(n)
            n = n.parent
        dm = res.dev_members
        moved = 0
        for n in path:
            if n.lock_ref == 0:
                moved += n.size
                n.lock_ref = 1
                if n in dm:
                    dm.discard(n)
                    n.heap_stamp[0] = 0
            else:
                n.lock_ref += 1
        if moved:
            res.evictable_tokens -= moved
            res.protected_tokens += moved

    def _host_lock_path(self, node: TreeNode) -> None:
        res = self.res
        root = res.root
        hm, rm = res.host_members, res.reclaim_members
        while node is not root:
            node.host_lock_ref += 1
            if node.host_lock_ref == 1:
                # A host-locked node is in neither host index (inlined refresh: nothing else changes).
                if node in hm:
                    res.host_index.set_member(node, False)
                if node in rm:
                    res.reclaim_index.set_member(node, False)
            node = node.parent

    def _host_unlock_path(self, node: TreeNode) -> None:
        res = self.res
        root = res.root
        while node is not root:
            node.host_lock_ref -= 1
            if node.host_lock_ref == 0:
                res.refresh(node)
            node = node.parent

    def _lock_both_paths(self, node: TreeNode, dev_from: TreeNode) -> None:
        res = self.res
        root = res.root
        dm, hm, rm = res.dev_members, res.host_members, res.reclaim_members
        moved = 0
        dev = dev_from is node  # device locks start at dev_from; host locks at node
        while node is not root:
            if node is dev_from:
                dev = True
            if dev:
                if node.lock_ref == 0:
                    moved += node.size
                    node.lock_ref = 1
                    if node in dm:
                        dm.discard(node)
                        node.heap_stamp[0] = 0
                else:
                    node.lock_ref += 1
            node.host_lock_ref += 1
            if node.host_lock_ref == 1:
                if node in hm:
                    res.host_index.set_member(node, False)
                if node in rm:
                    res.reclaim_index.set_member(node, False)
            node = node.parent
        if moved:
            res.evictable_tokens -= moved
            res.protected_tokens += moved

    def _unlock_both_paths(self, node: TreeNode) -> None:
        res = self.res
        root = res.root
        dl = res.device_index
        moved = 0
        while node is not root:
            node.lock_ref -= 1
            node.host_lock_ref -= 1
            if node.lock_ref == 0:
                moved += node.size
                if node.dev_children == 0:  # as in _unlock
                    dl.set_member(node, True)
            if node.host_lock_ref == 0 and node.host_children == 0 and node.host_value is not None:
                res.refresh(node)  # it may join a host index now
            node = node.parent
        if moved:
            res.evictable_tokens += moved
            res.protected_tokens -= moved


class CallerLocks:
    """The device locks callers hold (``inc_lock_ref``, the request helpers), counted per node:
    ``dec_lock_ref(node)`` releases one lock a caller took on exactly that node and never a
    lock the cache took for itself (a transfer's, an L3 pin), so no caller can release what
    it did not take. Locks on one node are interchangeable (same path, same counts)."""

    def __init__(self, locks: PathLocks) -> None:
        self.locks = locks
        self.by_node: dict[TreeNode, list[LockReceipt]] = {}

    def take(self, node: TreeNode) -> LockReceipt:
        receipt = self.locks.lock(node)
        self.by_node.setdefault(node, []).append(receipt)
        return receipt

    def holds(self, node: TreeNode) -> bool:
        return node in self.by_node

    def release(self, node: TreeNode) -> None:
        """Release one caller lock taken on exactly ``node``; ValueError (no change) if none."""
        held = self.by_node.get(node)
        if not held:
            raise ValueError(f"node: unlock below zero at {node!r} (no caller lock on it)")
        self.locks.release(held.pop())
        if not held:
            del self.by_node[node]

    def release_receipt(self, receipt: LockReceipt) -> None:
        """Release exactly this caller lock; ValueError (no change) if it is not a live one."""
        held = self.by_node.get(receipt.device)
        if not held or not any(r is receipt for r in held):
            raise ValueError(f"receipt: {receipt!r} is not a live caller lock of this cache")
        held.remove(receipt)
        if not held:
            del self.by_node[receipt.device]
        self.locks.release(receipt)

    def move(self, old: TreeNode, new: TreeNode) -> None:
        """One caller lock on ``old`` becomes one on ``new`` (see ``PathLocks.move``)."""
        held = self.by_node.get(old)
        if not held:
            raise ValueError(f"node: no caller lock on {old!r} to move")
        moved = self.locks.move(held.pop(), new)
        if not held:
            del self.by_node[old]
        self.by_node.setdefault(new, []).append(moved)

    def clear(self) -> None:
        """``reset``: callers' locks are forgotten with the tree."""
        for held in self.by_node.values():
            for receipt in held:
                receipt.live = False
        self.by_node.clear()

    def count(self) -> int:
        return sum(len(h) for h in self.by_node.values())
