// cudacheck initialises CUDA through the driver library of the container it
// runs in (libcuda.so.1, loaded at run time, as the CUDA runtime loads it),
// and for every device it sees prints its UUID and name after creating a
// context on it and allocating, writing and reading back device memory.
// Exit status 0 only if all of that worked on at least one device. The
// CUDA types it needs are declared here so that it builds without the CUDA
// toolkit.
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;

static void *sym(void *lib, const char *name) {
	void *f = dlsym(lib, name);
	if (f == NULL) {
		fprintf(stderr, "cudacheck: %s: %s\n", name, dlerror());
	}
	return f;
}

int main(void) {
	void *lib = dlopen("libcuda.so.1", RTLD_NOW);
	if (lib == NULL) {
		fprintf(stderr, "cudacheck: dlopen libcuda.so.1: %s\n", dlerror());
		return 2;
	}
	CUresult (*cuInit)(unsigned int) = sym(lib, "cuInit");
	CUresult (*cuDeviceGetCount)(int *) = sym(lib, "cuDeviceGetCount");
	CUresult (*cuDeviceGet)(CUdevice *, int) = sym(lib, "cuDeviceGet");
	CUresult (*cuDeviceGetName)(char *, int, CUdevice) = sym(lib, "cuDeviceGetName");
	CUresult (*cuDeviceGetUuid)(unsigned char *, CUdevice) = sym(lib, "cuDeviceGetUuid");
	CUresult (*cuCtxCreate)(CUcontext *, unsigned int, CUdevice) = sym(lib, "cuCtxCreate_v2");
	CUresult (*cuCtxDestroy)(CUcontext) = sym(lib, "cuCtxDestroy_v2");
	CUresult (*cuMemAlloc)(CUdeviceptr *, size_t) = sym(lib, "cuMemAlloc_v2");
	CUresult (*cuMemFree)(CUdeviceptr) = sym(lib, "cuMemFree_v2");
	CUresult (*cuMemcpyHtoD)(CUdeviceptr, const void *, size_t) = sym(lib, "cuMemcpyHtoD_v2");
	CUresult (*cuMemcpyDtoH)(void *, CUdeviceptr, size_t) = sym(lib, "cuMemcpyDtoH_v2");
	if (!cuInit || !cuDeviceGetCount || !cuDeviceGet || !cuDeviceGetName || !cuDeviceGetUuid || !cuCtxCreate ||
	    !cuCtxDestroy || !cuMemAlloc || !cuMemFree || !cuMemcpyHtoD || !cuMemcpyDtoH) {
		return 2;
	}
	CUresult r = cuInit(0);
	if (r != 0) {
		fprintf(stderr, "cudacheck: cuInit: error %d\n", r);
		return 3;
	}
	int count = 0;
	if ((r = cuDeviceGetCount(&count)) != 0 || count == 0) {
		fprintf(stderr, "cudacheck: cuDeviceGetCount: error %d, %d devices\n", r, count);
		return 3;
	}
	for (int i = 0; i < count; i++) {
		CUdevice dev;
		char name[256];
		unsigned char u[16];
		CUcontext ctx;
		CUdeviceptr mem;
		char in[4096], out[4096];
		if ((r = cuDeviceGet(&dev, i)) != 0 || (r = cuDeviceGetName(name, sizeof name, dev)) != 0 ||
		    (r = cuDeviceGetUuid(u, dev)) != 0) {
			fprintf(stderr, "cudacheck: device %d: error %d\n", i, r);
			return 4;
		}
		if ((r = cuCtxCreate(&ctx, 0, dev)) != 0) {
			fprintf(stderr, "cudacheck: device %d: cuCtxCreate: error %d\n", i, r);
			return 4;
		}
		for (size_t j = 0; j < sizeof in; j++) {
			in[j] = (char)(j * 7 + i);
		}
		memset(out, 0, sizeof out);
		if ((r = cuMemAlloc(&mem, sizeof in)) != 0 || (r = cuMemcpyHtoD(mem, in, sizeof in)) != 0 ||
		    (r = cuMemcpyDtoH(out, mem, sizeof out)) != 0 || (r = cuMemFree(mem)) != 0) {
			fprintf(stderr, "cudacheck: device %d: memory: error %d\n", i, r);
			return 4;
		}
		if (memcmp(in, out, sizeof in) != 0) {
			fprintf(stderr, "cudacheck: device %d: memory read back differs\n", i);
			return 4;
		}
		cuCtxDestroy(ctx);
		printf("GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x %s: context and memory ok\n",
		       u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15],
		       name);
	}
	return 0;
}
