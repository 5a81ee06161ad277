"""The receiving side of the data plane: ``KVReceiver``, each incoming transfer's state
machine, the acceptor of channels and their readers (see ``kvtransfer``)."""
