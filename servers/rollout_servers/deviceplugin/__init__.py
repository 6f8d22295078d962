"""A small Kubernetes device plugin that advertises N `nvidia.com/gpu` devices per node.

It speaks the kubelet's real device-plugin API (`deviceplugin/v1beta1`: `Register` on the
kubelet's socket, then `GetDevicePluginOptions`, `ListAndWatch`, `Allocate`,
`GetPreferredAllocation` and `PreStartContainer` on its own), so a pod's GPU request is
scheduled against capacity a kubelet reported and allocated by that kubelet, on nodes that have
no GPUs: the kind cluster's workers (docs/kind.md). The allocated device ids reach the
container's environment (`NVIDIA_VISIBLE_DEVICES`, as NVIDIA's plugin sets it). The messages are
encoded by hand (`wire`): eight small messages do not justify generated code and a protobuf
runtime in the image.
"""
