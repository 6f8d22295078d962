"""The node agent: plays the kubelet for one or more Nodes, running pods as local processes."""
