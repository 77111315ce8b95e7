"""The source of a plug-in eviction policy, as a user's module would hold it: least recently used, as the
built-in lru evicts. Tests that write plug-in modules to a temp directory start them with it and subclass it."""

LRU_SOURCE = '''
class LRUish:
    """Least recently used, as the built-in lru evicts (the last tick is unique)."""

    def __init__(self, capacity):
        self.last = {}

    def inserted(self, expert, tick):
        self.last[expert] = tick

    def accessed(self, expert, tick):
        self.last[expert] = tick

    def removed(self, expert):
        del self.last[expert]

    def victim(self, candidates, incoming):
        return min(candidates, key=self.last.__getitem__)

    def pick(self, loading, held, pinned, incoming):
        free = [e for e in self.last if e not in loading and e not in held and e not in pinned]
        return min(free, key=self.last.__getitem__) if free else None

    def forward_done(self):
        pass
'''
