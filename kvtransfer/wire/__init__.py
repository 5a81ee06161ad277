"""What crosses the wire: typed messages, packing paged blocks into parts, checksums;
``protocol`` is torch-free (see ``kvtransfer``)."""
