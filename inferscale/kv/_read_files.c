/* Whole-file reads of many open files in one call that holds no GIL (durable.py): a
   request's blobs are read by one thread while another checks the ones read before, with one
   GIL hand-off per batch instead of one per blob. Readahead of every file is asked for first
   (POSIX_FADV_WILLNEED), so the disk reads them together; a file counts as read only if it
   filled its buffer exactly and nothing follows it. */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <fcntl.h>
#include <unistd.h>

static int read_whole(int fd, char *at, Py_ssize_t size) {
    Py_ssize_t done = 0;
    char after;
    while (done < size) {
        ssize_t n = pread(fd, at + done, (size_t)(size - done), (off_t)done);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return 0;  /* an error, or the end before the buffer is full */
        done += n;
    }
    ssize_t more;
    do more = pread(fd, &after, 1, (off_t)size); while (more < 0 && errno == EINTR);
    return more == 0;
}

static PyObject *read_files(PyObject *self, PyObject *args) {
    PyObject *fds_arg, *buffers_arg;
    if (!PyArg_ParseTuple(args, "OO", &fds_arg, &buffers_arg)) return NULL;
    PyObject *fds = PySequence_Fast(fds_arg, "fds must be a sequence");
    if (fds == NULL) return NULL;
    PyObject *buffers = PySequence_Fast(buffers_arg, "buffers must be a sequence");
    if (buffers == NULL) {
        Py_DECREF(fds);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fds), taken = 0;
    int *fd = NULL, *ok = NULL;
    Py_buffer *views = NULL;
    PyObject *out = NULL;
    if (PySequence_Fast_GET_SIZE(buffers) != n) {
        PyErr_SetString(PyExc_ValueError, "as many buffers as fds");
        goto done;
    }
    fd = PyMem_Calloc((size_t)n + 1, sizeof(int));
    ok = PyMem_Calloc((size_t)n + 1, sizeof(int));
    views = PyMem_Calloc((size_t)n + 1, sizeof(Py_buffer));
    if (fd == NULL || ok == NULL || views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; taken < n; taken++) {
        long value = PyLong_AsLong(PySequence_Fast_GET_ITEM(fds, taken));
        if (value == -1 && PyErr_Occurred()) goto done;
        if (value < 0 || value > INT_MAX) {
            PyErr_SetString(PyExc_ValueError, "not a file descriptor");
            goto done;
        }
        fd[taken] = (int)value;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(buffers, taken), &views[taken],
                               PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        (void)posix_fadvise(fd[i], 0, 0, POSIX_FADV_WILLNEED);  /* a hint: errors change nothing */
    for (Py_ssize_t i = 0; i < n; i++) ok[i] = read_whole(fd[i], views[i].buf, views[i].len);
    Py_END_ALLOW_THREADS
    out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++)
        PyList_SET_ITEM(out, i, PyBool_FromLong(ok[i]));
done:
    for (Py_ssize_t i = 0; views != NULL && i < taken; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(fd);
    PyMem_Free(ok);
    PyMem_Free(views);
    Py_DECREF(fds);
    Py_DECREF(buffers);
    return out;
}

static PyMethodDef methods[] = {
    {"read_files", read_files, METH_VARARGS,
     "read_files(fds, buffers) -> [bool]: each file read whole into its buffer."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_read_files", NULL, -1, methods};

PyMODINIT_FUNC PyInit__read_files(void) { return PyModule_Create(&module); }
