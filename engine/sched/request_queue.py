"""Waiting queues: FCFS (a deque) and priority (a heap on (priority, arrival))."""

import heapq
from collections import deque

from engine.request import Request


class FCFSRequestQueue(deque):
    def add_request(self, request: Request) -> None:
        self.append(request)

    def prepend_request(self, request: Request) -> None:
        # A preempted request goes back to the front: it has waited once already.
        self.appendleft(request)

    def peek_request(self) -> Request:
        return self[0]

    def pop_request(self) -> Request:
        return self.popleft()

    def remove_request(self, request: Request) -> None:
        self.remove(request)


class PriorityRequestQueue:
    def __init__(self):
        self._heap: list[Request] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    # Priority order already decides who goes first, preempted or not.
    prepend_request = add_request

    def peek_request(self) -> Request:
        return self._heap[0]

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)

    def remove_request(self, request: Request) -> None:
        self._heap.remove(request)
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self):
        return iter(sorted(self._heap))


def create_request_queue(policy: str):
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {policy!r}.")
