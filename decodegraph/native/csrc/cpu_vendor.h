// Choices the kernels make once per process by the CPU's maker, where the same code runs
// at different speeds on Intel and AMD cores (docs/performance.md), each with an
// environment switch that overrides it for measurement.
#ifndef DECODEGRAPH_CPU_VENDOR_H
#define DECODEGRAPH_CPU_VENDOR_H

#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace decodegraph {

// Whether CPUID's vendor string says Intel (never on other architectures).
inline bool cpu_is_intel() {
#if defined(__x86_64__) || defined(__i386__)
    unsigned int eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid(0, &eax, &ebx, &ecx, &edx)) {
        char vendor[13];
        std::memcpy(vendor, &ebx, 4);
        std::memcpy(vendor + 4, &edx, 4);
        std::memcpy(vendor + 8, &ecx, 4);
        vendor[12] = '\0';
        return std::strcmp(vendor, "GenuineIntel") == 0;
    }
#endif
    return false;
}

// The environment variable `name` where it is "1" or "0", else `otherwise`.
inline bool env_switch(const char* name, bool otherwise) {
    const char* env = std::getenv(name);
    if (env != nullptr && (env[0] == '0' || env[0] == '1') && env[1] == '\0')
        return env[0] == '1';
    return otherwise;
}

}  // namespace decodegraph

#endif
