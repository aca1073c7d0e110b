"""Which stage a node holds: the node's drivers of ``protocol.placement``'s machine.

- ``runner``: feeds the machine events in real time and carries out its actions, through
  a clock and a view source (seams that tests replace).
- ``driver``: ``Placement``, what the node calls: the run's gossip topic, the swarm view
  from DHT records and gossip, and the announcements.
"""
