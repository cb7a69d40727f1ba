"""Import circles in a module graph, for the .ci/check_*_modules checks:
{module: set of modules it imports} in, one circle [a, b, ..., a] out for
each strongly connected set of more than one module."""

import sys


def strongly_connected(g):
    """The strongly connected sets of more than one module (Tarjan)."""
    index, low, stack, on, sets = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                sets.append(comp)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(g):
        if v not in index:
            visit(v)
    return sorted(sets, key=min)


def circles(g):
    """One circle [a, b, ..., a] through each strongly connected set."""
    return [cycle_in(g, comp) for comp in strongly_connected(g)]


def cycle_in(g, comp):
    """A shortest path from the set's first module back to itself, inside
    the set (breadth first)."""
    start = min(comp)
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(set(g[v]) & comp):
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return path[::-1] + [start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no circle in the strongly connected set {sorted(comp)}")
