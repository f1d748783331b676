/* The wrappers of the driver functions listed in wrapped.h, and their driver slots. */
#include "agent.h"

#define WRAP(name, params, args, tch, after)                                                       \
    void *volatile real_##name;                                                                    \
    EXPORT CUresult name params {                                                                  \
        CUresult(*fn) params = (CUresult(*) params)real_of(&real_##name, #name);                   \
        if (!fn)                                                                                   \
            return CUDA_ERROR_NOT_FOUND;                                                           \
        struct touch t = tch;                                                                      \
        t.call = #name;                                                                            \
        gate_enter(&t);                                                                            \
        CUresult r = fn args;                                                                      \
        after;                                                                                     \
        gate_exit();                                                                               \
        return r;                                                                                  \
    }
HOOKS(WRAP)
